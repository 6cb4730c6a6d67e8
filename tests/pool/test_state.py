"""PoolState decisions without any I/O."""

from __future__ import annotations

import pytest

from tensorcast.errors import ResourceExhausted
from tensorcast.pool.state import PoolState


def test_reserve_refuses_beyond_capacity_without_side_effects() -> None:
    s = PoolState(capacity=100)
    s.reserve(60)
    with pytest.raises(ResourceExhausted):
        s.reserve(41)
    assert s.reserved == 60
    s.reserve(40)
    assert s.reserved == 100


def test_blobs_are_shared_and_freed_with_their_last_artifact() -> None:
    s = PoolState(capacity=1000)
    for d, n in (("a", 10), ("b", 20), ("c", 30)):
        s.reserve(n)
        assert s.commit_blob(d, n)
    assert s.add_artifact("x", ("a", "b", "a"))
    assert not s.add_artifact("x", ("a", "b"))
    assert s.add_artifact("y", ("b", "c"))
    assert s.used == 60 and s.blob_refs == {"a": 1, "b": 2, "c": 1}
    assert sorted(s.remove_artifact("x")) == ["a"]
    s.free_blob("a")
    assert s.used == 50
    assert sorted(s.remove_artifact("y")) == ["b", "c"]
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
    assert s.release_unreferenced() == ["d"]
