"""PoolState decisions without any I/O: reservations, shared blobs, LRU eviction, pins, TTLs."""

from __future__ import annotations

import math

import pytest

from tensorcast.errors import ResourceExhausted
from tensorcast.pool.state import MemoryReplica, PoolState


def _store(s: PoolState, aid: str, blobs: dict[str, int], t: float, **kw: object) -> None:
    for d, n in blobs.items():
        if not s.has_blob(d):
            s.reserve(n)
            s.commit_blob(d, n)
    s.add_replica(MemoryReplica(aid, tuple(blobs), last_access=t, **kw))  # type: ignore[arg-type]


def test_reserve_refuses_beyond_capacity_without_side_effects() -> None:
    s = PoolState(capacity=100)
    s.reserve(60)
    with pytest.raises(ResourceExhausted):
        s.reserve(41)
    assert s.reserved == 60
    s.reserve(40)
    assert s.reserved == 100


def test_blobs_are_shared_and_freed_with_their_last_replica() -> None:
    s = PoolState(capacity=1000)
    _store(s, "x", {"a": 10, "b": 20}, 1)
    _store(s, "y", {"b": 20, "c": 30}, 2)
    assert s.used == 60 and s.blob_refs == {"a": 1, "b": 2, "c": 1}
    assert not s.add_replica(MemoryReplica("x", ("a", "b")))
    assert s.remove_replica("x") == ["a"]
    s.free_blob("a")
    assert s.used == 50
    assert sorted(s.remove_replica("y")) == ["b", "c"]
    for d in ("b", "c"):
        s.free_blob(d)
    assert s.used == 0 and not s.blob_refs


def test_duplicate_commit_reports_the_copy_to_free() -> None:
    s = PoolState(capacity=100)
    s.reserve(10)
    s.reserve(10)
    assert s.commit_blob("d", 10)
    assert not s.commit_blob("d", 10)
    assert s.used == 10 and s.reserved == 0
    assert s.unreferenced() == ["d"]


def test_victims_are_lru_and_skip_pinned_and_unevictable() -> None:
    s = PoolState(capacity=100)
    _store(s, "old", {"o": 30}, t=1)
    _store(s, "pinned", {"p": 30}, t=0, pinned_until=math.inf)
    _store(s, "fixed", {"f": 20}, t=0, evictable=False)
    _store(s, "new", {"n": 20}, t=5)
    assert s.free == 0
    assert s.victims(10, now=10) == ["old"]
    assert s.victims(40, now=10) == ["old", "new"]
    with pytest.raises(ResourceExhausted, match="could be freed"):
        s.victims(60, now=10)
    s.touch("old", 20)
    assert s.victims(10, now=30) == ["new"]
    # An expired pin no longer protects.
    s.replicas["pinned"].pinned_until = 25
    assert s.victims(80, now=30) == ["pinned", "new", "old"]


def test_evicting_a_sharer_frees_only_unshared_bytes() -> None:
    s = PoolState(capacity=100)
    _store(s, "a", {"shared": 40, "a1": 10}, t=1)
    _store(s, "b", {"shared": 40, "b1": 10}, t=2)
    _store(s, "c", {"c1": 40}, t=3)
    # Evicting "a" frees only its 10 own bytes: the shared 40 stay for "b".
    assert s.victims(15, now=9) == ["a", "b"]
    assert s.victims(10, now=9) == ["a"]


def test_pins_expiry_and_watermarks() -> None:
    s = PoolState(capacity=100)
    _store(s, "cold", {"c": 30}, t=1, memory_expires=5.0)
    _store(s, "warm", {"w": 60}, t=2)
    assert s.expired(4.0) == [] and s.expired(6.0) == ["cold"]
    s.pin("cold", None)
    assert s.expired(6.0) == [] and s.replicas["cold"].is_pinned(1e12)
    s.unpin("cold")
    assert s.watermark_victims(0.95, 0.5, now=10) == []  # 90% used, under the high mark
    _store(s, "more", {"m": 10}, t=3)
    assert s.watermark_victims(0.95, 0.5, now=10) == ["cold", "warm"]
