"""Routers' decisions on hand-made signals: load-aware, power of two, cache-aware at its boundaries, sticky."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from tensorcast.errors import InvalidArgument, Unavailable
from tensorcast.policies import (
    CacheAware,
    LoadAwareShared,
    PowerOfTwo,
    PrefixIndex,
    Request,
    SessionTable,
    StickySessions,
    block_keys,
    load,
)
from tensorcast.records import InstanceInfo


def inst(iid: str, running: int = 0, waiting: int = 0, kv: int = 0, alive: bool = True) -> InstanceInfo:
    return InstanceInfo(instance_id=iid, address=f"{iid}:1", home_worker=f"w-{iid}", running=running,
                        waiting=waiting, kv_tokens_used=kv, kv_tokens_capacity=100_000, alive=alive)


def tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 1000, n)]


def test_load_is_running_plus_waiting() -> None:
    assert load(inst("a", running=3, waiting=4, kv=999)) == 7


def test_load_aware_picks_least_loaded_live_instance_with_kv_then_order_tie_breaks() -> None:
    r = LoadAwareShared()
    req = Request("s", tokens(32, 0))
    assert r.route(req, [inst("a", 5), inst("b", 1, 1), inst("c", 3)]) == "b"
    assert r.route(req, [inst("a", 0, alive=False), inst("b", 2), inst("c", 3)]) == "b"  # dead a skipped
    assert r.route(req, [inst("a", 2, kv=50), inst("b", 2, kv=10), inst("c", 2, kv=10)]) == "b"
    with pytest.raises(Unavailable):
        r.route(req, [inst("a", alive=False)])
    with pytest.raises(Unavailable):
        r.route(req, [])


def test_power_of_two_never_picks_the_most_loaded_of_three_and_is_seeded() -> None:
    instances = [inst("a", 10), inst("b", 1), inst("c", 5)]
    r = PowerOfTwo(seed=7)
    picks = [r.route(Request(), instances) for _ in range(300)]
    counts = Counter(picks)
    assert "a" not in counts  # a is never the less loaded of any pair
    assert counts["b"] > counts["c"] > 0  # b wins both pairs it is in, c only the pair with a
    again = PowerOfTwo(seed=7)
    assert [again.route(Request(), instances) for _ in range(300)] == picks
    assert PowerOfTwo(seed=1).route(Request(), [inst("a", 9), inst("b", 0, alive=False)]) == "a"


def test_power_of_two_with_two_instances_always_takes_the_less_loaded() -> None:
    r = PowerOfTwo(seed=3)
    assert {r.route(Request(), [inst("a", 4), inst("b", 2)]) for _ in range(50)} == {"b"}


def _warm(router: CacheAware, prompt: list[int], on: str) -> None:
    router.observe(Request("warm", prompt), on)


def test_cache_aware_routes_to_the_prefix_holder_when_balanced() -> None:
    r = CacheAware()
    system = tokens(256, 1)
    _warm(r, system, "b")
    req = Request("s", system + tokens(64, 2))  # 256 of 320 tokens held by b: 0.8 > 0.3
    assert r.route(req, [inst("a", 0), inst("b", 40), inst("c", 3)]) == "b"  # 40 - 0 <= 64: balanced


def test_cache_aware_goes_to_least_loaded_when_imbalanced_even_with_a_prefix_holder() -> None:
    system = tokens(256, 1)
    req = Request("s", system + tokens(64, 2))
    for loads, want in [((0, 64), "b"),     # max - min = 64, not > 64: balanced, the holder
                        ((0, 65), "a"),     # 65 > 64 and 65 > 0 * 1.5: imbalanced, least loaded
                        ((130, 195), "b"),  # 65 > 64 but 195 == 130 * 1.5, not >: balanced
                        ((130, 196), "a")]:  # both conditions: imbalanced
        r = CacheAware()
        _warm(r, system, "b")
        assert r.route(req, [inst("a", loads[0]), inst("b", loads[1])]) == want, loads


def test_cache_aware_threshold_is_strict_and_a_miss_goes_to_the_least_loaded() -> None:
    prompt = tokens(10, 5)
    for held, want in [(3, "a"), (4, "b")]:  # 3/10 == 0.3 is not > 0.3; 4/10 is
        r = CacheAware(block_size=1)
        _warm(r, [*prompt[:held], 9999], "b")
        assert r.route(Request("s", prompt), [inst("a", 1), inst("b", 5)]) == want, held
    r = CacheAware(block_size=1)
    assert r.route(Request("s", []), [inst("a", 3), inst("b", 1)]) == "b"  # an empty prompt matches nothing


def test_cache_aware_learns_from_every_routed_request_and_ignores_dead_holders() -> None:
    r = CacheAware()
    first = Request("s1", tokens(320, 3))
    assert r.route(first, [inst("a", 0, kv=5), inst("b", 0)]) == "b"  # miss: least loaded, fewer KV tokens
    second = Request("s1", [*first.prompt, *tokens(32, 4)])
    assert r.route(second, [inst("a", 0), inst("b", 20)]) == "b"  # learned: b holds 320 of 352
    # Even an imbalanced decision is recorded: c now holds the prompt.
    assert r.route(Request("s2", tokens(160, 6)), [inst("b", 100), inst("c", 0)]) == "c"
    assert r.index.matched_tokens("c", r.index.keys(tokens(160, 6))) == 160
    assert r.route(second, [inst("a", 0), inst("b", 0, alive=False), inst("c", 1)]) == "a"


def test_cache_aware_prefers_the_less_loaded_of_equal_holders_and_smallest_index_on_miss() -> None:
    r = CacheAware()
    prompt = tokens(128, 8)
    _warm(r, prompt, "a")
    _warm(r, prompt, "b")
    assert r.route(Request("s", prompt), [inst("a", 9), inst("b", 2), inst("c", 0)]) == "b"
    r = CacheAware(miss="smallest_index")
    _warm(r, tokens(512, 9), "a")
    _warm(r, tokens(64, 10), "b")
    # A miss goes to the instance with the fewest indexed blocks (the gateway's choice), not the least loaded.
    assert r.route(Request("s", tokens(64, 11)), [inst("a", 0), inst("b", 3), inst("c", 5)]) == "c"
    assert r.route(Request("s", tokens(64, 12)), [inst("a", 0), inst("b", 3)]) == "b"


def test_cache_aware_rejects_bad_settings() -> None:
    with pytest.raises(InvalidArgument):
        CacheAware(cache_threshold=1.5)
    with pytest.raises(InvalidArgument):
        CacheAware(balance_abs=-1)
    with pytest.raises(InvalidArgument):
        CacheAware(miss="random")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        PrefixIndex(block_size=0)


def test_block_keys_name_whole_prefixes() -> None:
    a = tokens(100, 1)
    b = [*a[:48], *tokens(52, 2)]
    ka, kb = block_keys(a, 16), block_keys(b, 16)
    assert len(ka) == 6  # 100 tokens: 6 whole blocks, the partial one has no key
    assert ka[:3] == kb[:3] and all(x != y for x, y in zip(ka[3:], kb[3:], strict=True))
    c = [a[0] + 1, *a[1:]]  # a different first token changes every key after it
    assert not set(block_keys(c, 16)) & set(ka)
    assert block_keys(np.asarray(a, dtype=np.int32), 16) == ka  # arrays and lists hash alike


def test_prefix_index_is_bounded_and_evicts_leaves_before_their_prefixes() -> None:
    index = PrefixIndex(block_size=4, max_blocks=6)
    old = tokens(16, 1)  # 4 blocks
    index.insert("a", index.keys(old))
    new = tokens(12, 2)  # 3 more: the oldest leaf of `old` goes, its prefix stays
    index.insert("a", index.keys(new))
    assert index.size("a") == 6
    assert index.matched_tokens("a", index.keys(old)) == 12
    assert index.matched_tokens("a", index.keys(new)) == 12
    index.remove("a")
    assert index.size("a") == 0 and index.matched_tokens("a", index.keys(new)) == 0


def test_sticky_sessions_keep_a_session_on_its_instance_until_it_dies_or_moves() -> None:
    table = SessionTable()
    router = StickySessions(LoadAwareShared(), table)
    assert router.route(Request("s1"), [inst("a", 0), inst("b", 1)]) == "a"
    assert router.route(Request("s1"), [inst("a", 9), inst("b", 1)]) == "a"  # sticky despite the load
    assert router.route(Request(""), [inst("a", 9), inst("b", 1)]) == "b"  # no session: the inner router
    assert "" not in table
    table.assign("s1", "b")  # what a completed move does
    assert router.route(Request("s1"), [inst("a", 0), inst("b", 9)]) == "b"
    assert router.route(Request("s1"), [inst("a", 0), inst("b", 0, alive=False), inst("c", 3)]) == "a"
    assert table.get("s1") == "a" and table.on("a") == ["s1"] and len(table) == 1
    table.forget("s1")
    assert table.get("s1") is None


def test_spill_sends_a_turn_off_a_busier_instance_and_replaces_its_session() -> None:
    table = SessionTable()
    router = StickySessions(LoadAwareShared(), table, spill=0)
    assert router.route(Request("s1"), [inst("a", 0), inst("b", 1)]) == "a"
    # a ties with the least loaded (load, then KV in use): the session stays.
    assert router.route(Request("s1"), [inst("a", 1, kv=5), inst("b", 1, kv=5)]) == "a"
    # a is as busy in requests but holds more KV in flight (least_loaded's tie-break): the turn goes to b.
    assert router.route(Request("s1"), [inst("a", 1, kv=9), inst("b", 1, kv=5)]) == "b"
    assert table.get("s1") == "b"  # placed where the turn went (its KV is there now)
    assert router.route(Request("s1"), [inst("a", 0), inst("b", 3)]) == "a"
    # spill=2: a session stays while its instance has at most two requests more than the least loaded.
    lax = StickySessions(LoadAwareShared(), SessionTable(), spill=2)
    assert lax.route(Request("s"), [inst("a", 0), inst("b", 1)]) == "a"
    assert lax.route(Request("s"), [inst("a", 2), inst("b", 0)]) == "a"
    assert lax.route(Request("s"), [inst("a", 3), inst("b", 0)]) == "b"
    # without spill (the default) nothing moves a turn off a live instance.
    assert StickySessions(LoadAwareShared()).spill is None
    with pytest.raises(InvalidArgument):
        StickySessions(LoadAwareShared(), spill=-1)


def test_sticky_turns_still_teach_the_cache_aware_index() -> None:
    inner = CacheAware()
    router = StickySessions(inner)
    first = tokens(64, 1)
    assert router.route(Request("s", first), [inst("a", 0), inst("b", 1)]) == "a"
    grown = [*first, *tokens(64, 2)]
    assert router.route(Request("s", grown), [inst("a", 5), inst("b", 0)]) == "a"
    assert inner.index.matched_tokens("a", inner.index.keys(grown)) == 128
    assert router.choose(Request("other", grown), [inst("a", 5), inst("b", 0)]) == "a"  # a holds it all
