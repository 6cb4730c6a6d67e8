"""KV pieces without sockets: page keys, HRW, lease rules (fake clock), the page store."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tensorcast.errors import InvalidArgument, ResourceExhausted, StaleFencingToken
from tensorcast.kv.blocks import BlockRegions
from tensorcast.kv.hrw import assignment, candidates
from tensorcast.kv.keys import MAX_KEY_BYTES, KVLayout, check_keys, page_keys, shard_of
from tensorcast.kv.leases import HomeLeases, LeaseFeed, LeaseMirror, LeaseRecord, grant, live_homes, release, renew
from tensorcast.kv.pages import PageStore
from tensorcast.testing import leaked_segments

LAYOUT = KVLayout("model-a", layers=4, kv_heads=2, head_dim=64, dtype="bfloat16", page_size=16)


def test_page_keys_are_chained_prefix_hashes() -> None:
    tokens = list(range(100))
    keys = page_keys(tokens, LAYOUT)
    assert len(keys) == 6  # 100 // 16 full pages
    assert page_keys(tokens[:40], LAYOUT) == keys[:2]  # a prefix has the prefix's keys
    assert page_keys([*tokens[:16], 999, *tokens[17:]], LAYOUT)[1:] != keys[1:]  # a change moves every later key
    other_model = KVLayout("model-b", 4, 2, 64, "bfloat16", 16)
    other_layout = KVLayout("model-a", 4, 2, 64, "float16", 16)
    assert page_keys(tokens, other_model)[0] != keys[0] and page_keys(tokens, other_layout)[0] != keys[0]
    assert LAYOUT.page_bytes == 2 * 4 * 2 * 64 * 16 * 2
    assert 0 <= shard_of(keys[0], 256) < 256
    with pytest.raises(InvalidArgument):
        KVLayout("m", 0, 1, 1, "float16", 1)


def test_any_string_is_a_key_and_keys_of_any_shape_spread_over_shards() -> None:
    engine_keys = {
        "vllm block hashes": [str(h) for h in range(10**18, 10**18 + 4096)],  # sequential integers
        "sglang hashes with rank suffixes": [f"{i:064x}_0_1" for i in range(4096)],
        "lmcache chunk keys": [f"vllm@qwen@1@0@{i}" for i in range(4096)],
    }
    for what, keys in engine_keys.items():
        check_keys(keys)
        counts = [0] * 64
        for key in keys:
            counts[shard_of(key, 64)] += 1
        assert min(counts) > 0.5 * len(keys) / 64 and max(counts) < 1.5 * len(keys) / 64, (what, counts)
    check_keys(["é" * (MAX_KEY_BYTES // 2)])
    for bad in ["", "x" * (MAX_KEY_BYTES + 1), "é" * (MAX_KEY_BYTES // 2 + 1), 7, b"bytes"]:
        with pytest.raises(InvalidArgument, match="key 1"):
            check_keys(["fine", bad])  # type: ignore[list-item]


@pytest.mark.parametrize("homes", [3, 4, 5, 8])
def test_hrw_is_balanced_and_stable(homes: int) -> None:
    workers = [f"w{i}" for i in range(homes)]
    owner = assignment(256, workers)
    counts = {w: sum(1 for o in owner.values() if o == w) for w in workers}
    assert max(counts.values()) <= 2 * 256 / homes, counts
    # Removing one home moves only the shards it owned.
    after = assignment(256, workers[1:])
    assert all(after[s] == owner[s] for s in owner if owner[s] != "w0")
    assert candidates(7, workers, 3) == candidates(7, list(reversed(workers)), 3)


def test_lease_rules_and_fencing_tokens() -> None:
    r = grant(None, 5, "a", now=0, ttl=3)
    assert r == LeaseRecord(5, "a", 1, 3, 0)
    assert grant(r, 5, "b", now=2, ttl=3) is None  # held by a
    assert grant(r, 5, "a", now=2, ttl=3).expiry == 5  # type: ignore[union-attr]
    r2 = grant(r, 5, "b", now=3.5, ttl=3)  # expired: b gets it with a higher token
    assert r2 is not None and r2.holder == "b" and r2.token == 2
    assert renew(r2, "a", 1, now=4, ttl=3) is None  # a's old token is fenced off
    assert renew(r2, "b", 2, now=4, ttl=3).expiry == 7  # type: ignore[union-attr]
    assert renew(r2, "b", 2, now=9, ttl=3) is None  # too late
    gone = release(r2, "b", 2)
    assert gone is not None and gone.holder == "" and grant(gone, 5, "a", now=4, ttl=3).token == 3  # type: ignore[union-attr]


def test_home_refuses_after_local_expiry_and_stale_tokens() -> None:
    h = HomeLeases("a")
    h.granted(1, token=4, sent_at=100.0, ttl=3.0)
    h.check(1, 4, now=101.0)
    with pytest.raises(StaleFencingToken):
        h.check(1, 3, now=101.0)
    with pytest.raises(StaleFencingToken):
        h.check(1, 4, now=103.0)  # paused past its lease: refuses before talking to anyone
    with pytest.raises(StaleFencingToken):
        h.check(2, 1, now=101.0)
    assert h.expired(103.0) == [1]


def test_home_stops_serving_a_margin_before_the_store_expiry() -> None:
    h = HomeLeases("a", margin=0.5)
    h.granted(1, token=4, sent_at=100.0, ttl=3.0)  # the store expires it at >= 103.0
    h.check(1, 4, now=102.4)
    with pytest.raises(StaleFencingToken):
        h.check(1, 4, now=102.5)
    assert h.expired(102.5) == [1]


def test_home_acquisition_plan() -> None:
    homes = ["a", "b", "c", "d"]
    rank0 = {s: candidates(s, homes, 3)[0] for s in range(16)}
    a = HomeLeases("a")
    acquire, give = a.plan({}, homes, 16, gs_now=10, grace=0.25)
    assert sorted(acquire) == sorted(s for s, w in rank0.items() if w == "a") and give == []
    # A shard a is second for, whose lease just expired: a waits a grace period, then asks.
    s = next(s for s in range(16) if candidates(s, homes, 3)[1] == "a")
    rec = {s: LeaseRecord(s, rank0[s], 1, expiry=10.0)}
    assert s not in a.plan(rec, homes, 16, gs_now=10.1, grace=0.25)[0]
    dead_first = [h for h in homes if h != rank0[s]]
    assert s in a.plan(rec, dead_first, 16, gs_now=10.1, grace=0.25)[0]
    # Its lease expired long ago: a takes it over, unless the store was just unreachable (every lease
    # expired at once while their holders lived): then rank 0 re-acquires its own.
    assert s in a.plan(rec, homes, 16, gs_now=11.0, grace=0.25)[0]
    assert s not in a.plan(rec, homes, 16, gs_now=11.0, grace=0.25, takeover=False)[0]
    mine = next(s for s, w in rank0.items() if w == "a")
    assert mine in a.plan({mine: LeaseRecord(mine, "a", 1, expiry=10.0)}, homes, 16, gs_now=11.0, grace=0.25,
                          takeover=False)[0]
    # Holding a shard whose rank-0 home is alive again: give it back.
    a.granted(s, 2, 0.0, 100.0)
    assert s in a.plan({}, homes, 16, gs_now=10, grace=0.25)[1]


@pytest.mark.parametrize(("cut_off", "want"), [
    (None, ["a", "b"]),  # heard from within the TTL of now
    (100.0, ["a", "b", "c", "d"]),  # cut off from the store since 100: heard within the TTL before then too
    (101.0, ["a", "b", "c"]),
    (200.0, ["a", "b"]),  # a cut-off "after now" counts from now
])
def test_live_homes_count_the_time_a_home_was_cut_off(cut_off: float | None, want: list[str]) -> None:
    beats = {"b": 104.5, "a": 103.0, "c": 99.0, "d": 97.5, "e": 90.0}
    assert live_homes(beats, now=105.0, ttl=3.0, cut_off=cut_off) == want


def test_lease_deltas_carry_changes_of_holder_token_or_liveness_not_renewals() -> None:
    feed, mirror = LeaseFeed("e1"), LeaseMirror()
    table = {s: LeaseRecord(s, "a", 1, expiry=10.0, acquired_at=0.0) for s in range(64)}

    def follow(now: float) -> int:
        """One reader's catch-up at the store's clock ``now``: how many records the answer carried."""
        feed.observe(table, now)
        full, shards = feed.since(mirror.epoch, mirror.revision)
        mirror.apply(full, (table[s] for s in shards), now, feed.revision, feed.epoch)
        return len(shards)

    assert follow(now=1.0) == 64  # the first read is the whole table
    for tick in range(2, 9):  # every lease renewed each tick: nothing for the reader
        table = {s: replace(r, expiry=tick + 10.0) for s, r in table.items()}
        assert follow(now=float(tick)) == 0
    vacant = lambda now: [s for s, r in mirror.records.items() if r.expiry <= now]  # noqa: E731
    assert vacant(now=1e9) == []  # reported live: live until the store says otherwise
    table[3] = replace(table[3], holder="b", token=2)  # handed over
    table[5] = replace(table[5], holder="", expiry=0.0)  # released
    assert follow(now=9.0) == 2 and mirror.records[3].holder == "b" and vacant(now=9.0) == [5]
    # Shard 7's holder stops renewing: once the store's clock passes its expiry, it is reported, with the
    # real expiry (lower-ranked candidates count their wait from it).
    frozen = table[7].expiry
    table = {s: (r if s in (5, 7) else replace(r, expiry=30.0)) for s, r in table.items()}
    assert follow(now=frozen - 0.5) == 0
    assert follow(now=frozen + 0.5) == 1 and mirror.records[7].expiry == frozen
    assert sorted(vacant(now=frozen + 0.5)) == [5, 7]
    # Another store's numbering: the whole table again, and nothing of the old one kept.
    other = LeaseFeed("e2")
    other.observe({1: table[1]}, 20.0)
    full, shards = other.since(mirror.epoch, mirror.revision)
    mirror.apply(full, [table[s] for s in shards], 20.0, other.revision, other.epoch)
    assert full and list(mirror.records) == [1]


def test_page_store_lru_ttl_shards_and_leases() -> None:
    store = PageStore(4 * 8192, "tctest-pages", arena_bytes=64 * 1024, max_page_bytes=8192, default_ttl=None)
    try:
        for i in range(4):
            page, view = store.reserve(shard=i % 2, key=f"k{i}", nbytes=8000, now=0)
            view[:] = bytes([i]) * 8000
            store.commit(f"k{i}", page, None, now=0)
        assert store.get("k0", now=1) is not None  # k0 becomes most recently used
        page, view = store.reserve(0, "k4", 8000, now=2)  # full: evicts the LRU page, k1
        store.commit("k4", page, ttl=5.0, now=2)
        assert store.get("k1", now=2) is None and store.get("k0", now=2) is not None
        assert store.get("k4", now=8) is None  # expired
        held = store.get("k2", now=3)
        assert held is not None
        release = store.hold([held])
        view = store.view(held)
        assert store.drop_shard(0) >= 1  # drops k0, k2 (shard 0)
        assert store.get("k2", now=3) is None
        for i in range(3):  # refill: the leased slot must not be reused
            p, v = store.reserve(1, f"n{i}", 8000, now=4)
            v[:] = b"\xff" * 8000
            store.commit(f"n{i}", p, None, now=4)
        assert bytes(view[:4]) == bytes([2]) * 4
        release()
        with pytest.raises(InvalidArgument):
            store.reserve(0, "big", 9000, now=5)
        tiny = PageStore(4096, "tctest-pages2", arena_bytes=64 * 1024, max_page_bytes=8192)
        with pytest.raises(ResourceExhausted):
            tiny.reserve(0, "x", 8000, now=0)
        tiny.close()
    finally:
        store.close()
    assert not leaked_segments("tctest-pages")


def test_ttl_expiry_is_exact_after_overwrites_and_heap_rebuilds() -> None:
    store = PageStore(64 << 20, "tctest-ttl", arena_bytes=1 << 20, max_page_bytes=8192)
    try:
        for i in range(3000):  # overwrite the same 100 keys with growing TTLs: stale heap entries pile up
            page, view = store.reserve(shard=i % 4, key=f"k{i % 100}", nbytes=4096, now=0)
            view[:8] = i.to_bytes(8, "little")
            store.commit(f"k{i % 100}", page, ttl=float(i), now=0)
        assert len(store._expiry) <= 2 * len(store.index) + 1024 + 1  # rebuilt, not unbounded
        # Each key now lives until its last write's TTL (2900 + key): earlier entries must not expire it.
        assert all(store.get(f"k{k}", now=2899) is not None for k in range(100))
        gone = [k for k in range(100) if store.get(f"k{k}", now=2950.5) is None]
        assert gone == list(range(51))  # TTLs 2900..2950 have passed, 2951..2999 have not
        store.default_ttl = None  # pages without a TTL never expire
        page, _ = store.reserve(0, "no-ttl", 4096, now=0)
        store.commit("no-ttl", page, ttl=None, now=0)
        store.expire(now=1e12)
        assert list(store.index) == ["no-ttl"]
    finally:
        store.close()


def test_block_regions_gather_and_scatter_pages_across_layers() -> None:
    import torch

    # A vLLM-like cache: per layer, K and V as [num_blocks, block_size, kv_heads, head_dim] in bfloat16.
    torch.manual_seed(0)
    layers = [torch.randn(2, 10, 16, 2, 8).to(torch.bfloat16) for _ in range(3)]
    regions = BlockRegions([kv[i] for kv in layers for i in range(2)])
    assert regions.num_blocks == 10 and regions.page_bytes == 3 * 2 * 16 * 2 * 8 * 2
    pages = regions.gather(regions.block_ids([7, 2], 2))
    assert pages.shape == (2, regions.page_bytes)
    first = torch.cat([kv[i][7].reshape(-1) for kv in layers for i in range(2)]).view(torch.uint8).numpy()
    assert (pages[0] == first).all()
    target = [torch.zeros_like(kv) for kv in layers]
    into = BlockRegions([kv[i] for kv in target for i in range(2)])
    into.scatter(into.block_ids([4, 9], 2), pages)
    for t, s in zip(target, layers, strict=True):
        assert torch.equal(t[:, 4], s[:, 7]) and torch.equal(t[:, 9], s[:, 2])
    assert all(not t[:, :4].any() for t in target)  # other blocks untouched
    with pytest.raises(InvalidArgument):
        regions.block_ids([10], 1)
    with pytest.raises(InvalidArgument):
        regions.block_ids([1, 2], 1)
    with pytest.raises(InvalidArgument):
        BlockRegions([torch.zeros(4, 8), torch.zeros(5, 8)])
    with pytest.raises(InvalidArgument):
        BlockRegions([torch.zeros(8, 4).t()])  # rows not contiguous


def test_mla_layouts_hold_one_latent_per_token() -> None:
    from tensorcast.kv.keys import KVLayout

    mha = KVLayout("m", layers=2, kv_heads=1, head_dim=576, dtype="bfloat16", page_size=16)
    mla = KVLayout("m", layers=2, kv_heads=1, head_dim=576, dtype="bfloat16", page_size=16, kind="mla")
    assert mla.page_shape == (2, 16, 576) and mla.page_bytes == 2 * 16 * 576 * 2
    assert mha.page_bytes == 2 * mla.page_bytes  # K and V where MLA keeps one latent
    assert mla.layout_id != mha.layout_id  # never each other's pages
    assert mha.layout_id == KVLayout("m", 2, 1, 576, "bfloat16", 16).layout_id  # ids of existing layouts stay
    mla.check_page(mla.page_bytes, (2, 16, 576))
    with pytest.raises(InvalidArgument):
        mla.check_page(mla.page_bytes, (2, 1, 16, 576))
    for bad in ({"kind": "gqa"}, {"kind": "mla", "kv_heads": 2}):
        with pytest.raises(InvalidArgument):
            KVLayout(**{"model_id": "m", "layers": 2, "kv_heads": 1, "head_dim": 8, "dtype": "float16",
                        "page_size": 4, **bad})  # type: ignore[arg-type]
