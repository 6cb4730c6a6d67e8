"""Weight sync's pure parts without a cluster: version keys and GC decisions, one binding's swap state
(compare-and-swap, idempotent retries, aborts, expiry), fetch groups, and the sync twins of the API."""

from __future__ import annotations

import inspect

import pytest

from tensorcast.client.binding import AsyncBinding
from tensorcast.client.publisher import AsyncWeightPublisher
from tensorcast.client.staging import Job, groups_of
from tensorcast.client.weights_sync import Binding, WeightPublisher
from tensorcast.errors import InvalidArgument, SwapAborted, VersionConflict
from tensorcast.weights.swap_state import NOOP, PREPARE, READY, SwapState
from tensorcast.weights.versions import (
    Backoff,
    check_holder,
    check_model,
    gc_decision,
    next_version,
    parse_use_key,
    parse_version_key,
    use_key,
    use_tag,
    version_key,
    version_tag,
    versions_in_use,
)


def test_keys_round_trip_and_reject_lookalikes() -> None:
    assert version_key("Qwen/Qwen3-8B", 12) == "Qwen/Qwen3-8B@v12"
    assert parse_version_key("Qwen/Qwen3-8B", "Qwen/Qwen3-8B@v12") == 12
    for key in ("Qwen/Qwen3-8B@v", "Qwen/Qwen3-8B@v012", "Qwen/Qwen3-8B@v1x", "Qwen/Qwen3-8B2@v1", "m@v0"):
        assert parse_version_key("Qwen/Qwen3-8B", key) is None, key
    assert parse_use_key("m", use_key("m", 3, "eng-r0")) == (3, "eng-r0")
    assert parse_use_key("m", "m@use/v3/a/b") is None and parse_use_key("m", "m@use/x3/a") is None
    assert versions_in_use("m", ["m@use/v3/b", "m@use/v3/a", "m@use/v4/a", "other@use/v1/a"]) == \
        {3: ("a", "b"), 4: ("a",)}
    for bad in ("", "a@b", "x\n"):
        with pytest.raises(InvalidArgument):
            check_model(bad)
    for bad in ("", "a/b", "a@b"):
        with pytest.raises(InvalidArgument):
            check_holder(bad)
    with pytest.raises(InvalidArgument):
        version_key("m", 0)
    # Tags make every version (and every use record) its own artifact.
    assert bytes(version_tag("m", 1)) != bytes(version_tag("m", 2)) != bytes(version_tag("n", 2))
    assert bytes(use_tag("m", 1, "a")) != bytes(use_tag("m", 1, "b"))


def test_gc_keeps_the_newest_and_those_in_use() -> None:
    assert gc_decision([1, 2, 3, 4, 5], {}, keep_last=2) == [1, 2, 3]
    assert gc_decision([1, 2, 3, 4, 5], {2: ("r0",)}, keep_last=2) == [1, 3]
    assert gc_decision([5, 1, 3], [1, 3, 5], keep_last=1) == []
    assert gc_decision([], {}, keep_last=1) == []
    with pytest.raises(InvalidArgument):
        gc_decision([1], {}, keep_last=0)
    assert next_version([]) == 1 and next_version([3, 7]) == 8


def test_backoff_is_bounded_and_stops_at_the_deadline() -> None:
    b = Backoff(initial=0.05, maximum=1.0)
    assert [b.delay(i, 0, None) for i in range(6)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0]
    assert b.delay(100, 0, None) == 1.0
    assert b.delay(3, 10.0, 10.1) == pytest.approx(0.1) and b.delay(3, 11.0, 10.0) == 0.0


def test_swap_state_compare_and_swap_and_idempotent_retries() -> None:
    s = SwapState(staging_ttl=60)
    assert s.begin_prepare("a", 1, expected=0, now=0) == PREPARE
    with pytest.raises(VersionConflict):
        s.begin_prepare("a", 1, expected=3, now=0)
    s.prepared("a", 1, now=0)
    assert s.begin_prepare("a", 1, expected=0, now=1) == READY  # a repeated prepare: already staged
    with pytest.raises(VersionConflict):
        s.begin_activate("a", expected=5, now=1)
    staged = s.begin_activate("a", expected=0, now=1)
    assert staged is not None and staged.version == 1
    s.activated(staged)
    assert s.active == 1 and s.staged is None
    assert s.begin_activate("a", expected=0, now=2) is None  # a repeated activation: done already
    assert s.begin_prepare("b", 1, expected=0, now=2) == NOOP  # the version is active: a retried swap
    with pytest.raises(SwapAborted, match="not staged"):
        s.begin_activate("zzz", expected=None, now=2)


def test_swap_state_abort_replace_and_expiry() -> None:
    s = SwapState(staging_ttl=10)
    s.begin_prepare("a", 2, expected=None, now=0)
    s.prepared("a", 2, now=0)
    replaced = s.prepared("b", 3, now=1)  # another coordinator's swap replaces a stale staging
    assert replaced is not None and replaced.swap_id == "a" and s.staged is not None and s.staged.swap_id == "b"
    assert s.abort("b") is not None and s.staged is None
    with pytest.raises(SwapAborted, match="aborted"):
        s.begin_prepare("b", 3, expected=None, now=2)  # a late or repeated prepare of an aborted swap
    s.begin_prepare("c", 3, expected=None, now=2)
    s.abort("c")  # the abort comes while it is fetching
    with pytest.raises(SwapAborted, match="aborted while"):
        s.prepared("c", 3, now=3)
    s.prepared("d", 4, now=3)
    with pytest.raises(SwapAborted, match="expired"):
        s.begin_activate("d", expected=None, now=13)  # nobody decided within the staging TTL
    s.activation_failed()
    assert s.active == 0


def test_fetch_groups_are_bounded_and_keep_order() -> None:
    def jobs(*sizes: int) -> list[Job]:
        return [Job((str(i), str(i)), str(i), (), n) for i, n in enumerate(sizes)]

    assert [len(g) for g in groups_of(jobs(10, 10, 10))] == [3]  # small: one fetch
    mib = 1024**2
    groups = groups_of(jobs(*[8 * mib] * 16), max_groups=4, min_bytes=16 * mib)
    assert len(groups) == 4 and [j for g in groups for j in g] == jobs(*[8 * mib] * 16)
    assert len(groups_of(jobs(64 * mib, 1, 1), max_groups=4, min_bytes=16 * mib)) <= 3
    assert groups_of([]) == []


def _params(fn: object) -> list[tuple[str, object, object, object]]:
    sig = inspect.signature(fn, eval_str=True)  # type: ignore[arg-type]
    return [(p.name, p.kind, p.default, p.annotation) for p in sig.parameters.values()]


@pytest.mark.parametrize(("aio", "sync"), [(AsyncWeightPublisher, WeightPublisher), (AsyncBinding, Binding)])
def test_every_async_method_has_a_sync_twin(aio: type, sync: type) -> None:
    for name, fn in inspect.getmembers(aio, inspect.iscoroutinefunction):
        if name.startswith("_") or name == "create":
            continue
        twin = getattr(sync, name, None)
        assert twin is not None, f"{sync.__name__}.{name} is missing"
        assert _params(twin) == _params(fn), name


def test_publisher_digests_reuse_only_what_is_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    import tensorcast.tensors as tensors_mod
    from tensorcast.tensors import digest_bytes, normalize_tensors

    hashed: list[int] = []
    real = tensors_mod.digest_bytes
    monkeypatch.setattr(tensors_mod, "digest_bytes", lambda data: hashed.append(len(data)) or real(data))
    pub = AsyncWeightPublisher(client=None, model="m")  # type: ignore[arg-type]  # no put here: no client
    rng = np.random.default_rng(0)
    state = {f"w{i}": rng.standard_normal(256, dtype=np.float32) for i in range(4)}
    left: list[str] = []

    def digests(changed: list[str] | None = None) -> dict[str, str]:
        """One publish's digests: those reused, then (as the put does) the others computed and remembered."""
        inputs = normalize_tensors(state)
        quick = pub._reuse_digests(inputs, changed)
        left[:] = [t.name for t in inputs if not t.digest]  # what the put hashes while it writes
        pub._remember(inputs, quick, {t.name: t.meta.digest for t in inputs})
        return {t.name: t.digest for t in inputs}

    first = digests()
    assert len(hashed) == 4 and left == list(state) and all(first[n] == digest_bytes(v) for n, v in state.items())
    hashed.clear()
    state["w1"][7] += 1.0  # changed in place: same array, same address
    second = digests()
    assert hashed == [1024] and left == ["w1"]  # only w1 was hashed with BLAKE3
    assert all(second[n] == digest_bytes(v) for n, v in state.items()) and second["w1"] != first["w1"]
    hashed.clear()
    state["w2"] = state["w2"].reshape(16, 16)  # same bytes, another shape: a tensor of another kind
    assert digests()["w2"] == first["w2"] and hashed == [1024]
    hashed.clear()
    state["w0"][0] += 1.0
    state["w3"][0] += 1.0  # changed, but the caller says only w0 did: w3 is taken at its word, not read
    third = digests(changed=["w0"])
    assert hashed == [1024] and left == ["w0"] and third["w3"] == second["w3"] != digest_bytes(state["w3"])


def test_publish_refuses_changed_names_the_state_dict_lacks() -> None:
    import asyncio

    import numpy as np

    pub = AsyncWeightPublisher(client=None, model="m")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="lacks"):
        asyncio.run(pub.publish({"a": np.ones(2)}, changed=["b"]))
