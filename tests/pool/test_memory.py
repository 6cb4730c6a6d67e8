"""The memory tier's pack allocation and the pre-faulted stock, on real shared-memory segments (no worker)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from tensorcast.errors import ResourceExhausted
from tensorcast.pool.memory import MemoryTier
from tensorcast.pool.state import MemoryReplica
from tensorcast.pool.stock import SegmentStock

MiB = 1 << 20


@pytest.fixture()
def tier() -> Iterator[MemoryTier]:
    t = MemoryTier(256 * MiB, f"tc-test-{uuid.uuid4().hex[:8]}", stock_budget=32 * MiB, stock_chunk_bytes=8 * MiB)
    t.stock.refill()
    yield t
    t.close()


def test_pack_is_carved_out_of_stock_chunks_page_aligned(tier: MemoryTier) -> None:
    assert tier.stock.ready_bytes == 32 * MiB  # four chunks, pre-faulted
    sizes = [3 * MiB, 3 * MiB + 5, 1 * MiB, 6 * MiB, 100]  # small ones too: mappable, unlike arena slots
    locs = tier.allocate_pack(sizes)
    assert [loc.size for loc in locs] == sizes
    big = [loc for loc in locs if loc.arena is None]
    assert len(big) == 5
    assert len({id(loc.segment) for loc in big}) == 2  # 3 + 3 + 1 MiB in one chunk, 6 MiB + 100 B in the next
    assert tier.stock.ready_bytes == 16 * MiB
    assert all(loc.offset % os.sysconf("SC_PAGE_SIZE") == 0 for loc in big)
    first = big[0].segment
    assert os.stat(first.path).st_size == 8 * MiB  # the unused tails go back later, off the caller's path
    page = os.sysconf("SC_PAGE_SIZE")
    # Best fit, largest first: 6 MiB in one chunk; 3 MiB + 5 (a page more), 3 MiB, 1 MiB, 100 B in the other.
    # The chunk with the most room (2 MiB, holding the 6 MiB tensor) stays open for the next batch; the
    # other's tail goes back.
    assert tier.trim() == 8 * MiB - 7 * MiB - 2 * page
    assert os.stat(first.path).st_size < 8 * MiB and tier.trim() == 0
    assert os.stat(big[3].segment.path).st_size == 8 * MiB
    for i, loc in enumerate(locs):  # non-overlapping: each keeps its own bytes
        np.frombuffer(loc.view(), np.uint8)[:] = i + 1
    for i, loc in enumerate(locs):
        assert set(np.unique(np.frombuffer(loc.view(), np.uint8))) == {i + 1}
    assert tier.state.reserved == sum(sizes)


def test_pack_takes_as_few_chunks_as_fit(tier: MemoryTier) -> None:
    locs = tier.allocate_pack([5 * MiB, 5 * MiB, 3 * MiB, 3 * MiB])  # in order, 3 chunks; best fit, 2
    assert len({id(loc.segment) for loc in locs}) == 2
    assert tier.stock.ready_bytes == 16 * MiB


def test_without_stock_small_tensors_still_share_a_mappable_pack() -> None:
    t = MemoryTier(256 * MiB, f"tc-test-{uuid.uuid4().hex[:8]}", stock_budget=0, stock_chunk_bytes=8 * MiB)
    try:
        locs = t.allocate_pack([100, 1 * MiB, 3000, 5 * MiB, 3 * MiB])
        assert all(loc.arena is None for loc in locs)  # not arena slots: callers can map every one
        assert len({id(loc.segment) for loc in locs}) == 2  # 5 + 3 MiB, then 1 MiB + two pages: no waste
        assert sum(loc.segment.size for loc in {id(x.segment): x for x in locs}.values()) == 9 * MiB + 8192
    finally:
        t.close()


def test_the_next_batch_continues_in_the_open_chunk(tier: MemoryTier) -> None:
    (a,) = tier.allocate_pack([1 * MiB])
    (b,) = tier.allocate_pack([2 * MiB + 5])
    (c,) = tier.allocate_pack([1 * MiB])
    assert a.segment is b.segment is c.segment and (a.offset, b.offset, c.offset) == (0, MiB, 3 * MiB + 4096)
    assert tier.stock.ready_bytes == 24 * MiB  # one chunk for three batches, nothing to trim
    assert tier.trim() == 0
    for loc in (a, b, c):  # freed blobs' pages are not handed out again while the chunk lives
        tier.discard(loc)
    (d,) = tier.allocate_pack([1 * MiB])
    assert d.segment is a.segment and d.offset > c.offset


def test_freed_memory_no_caller_was_given_is_recycled_faulted(tier: MemoryTier) -> None:
    (a,) = tier.allocate_pack([7 * MiB + MiB // 2])  # too little room left to stay open
    seg = a.segment
    tier.commit_blob("a" * 64, a)
    tier.state.add_replica(MemoryReplica("x", ("a" * 64,)))
    ready = tier.stock.ready_bytes
    for digest in tier.state.remove_replica("x"):
        tier._free_blob(digest)
    assert os.path.exists(seg.path) and tier.stock.ready_bytes > ready  # back in the stock, pages and all
    (b,) = tier.allocate_pack([7 * MiB])
    assert b.segment is seg  # and reused for the next batch


def test_exported_memory_is_never_reused(tier: MemoryTier) -> None:
    (a,) = tier.allocate_pack([7 * MiB + MiB // 2])
    a.segment.exported = True  # a same-host caller was given it: it may have it mapped
    tier.commit_blob("a" * 64, a)
    tier.state.add_replica(MemoryReplica("x", ("a" * 64,)))
    ready = tier.stock.ready_bytes
    for digest in tier.state.remove_replica("x"):
        tier._free_blob(digest)
    assert not os.path.exists(a.segment.path) and tier.stock.ready_bytes == ready


def test_trim_skips_a_chunk_retired_meanwhile(tier: MemoryTier) -> None:
    (a,) = tier.allocate_pack([7 * MiB + MiB // 2])
    a.segment.exported = True  # (recycled otherwise)
    tier.discard(a)  # a failed fetch: the chunk goes with its only blob
    assert not os.path.exists(a.segment.path)
    assert tier.trim() == 0


def test_a_pack_segment_goes_with_its_last_blob(tier: MemoryTier) -> None:
    a, b = tier.allocate_pack([4 * MiB, 3 * MiB + MiB // 2])
    assert a.segment is b.segment
    tier.commit_blob("a" * 64, a)
    tier.commit_blob("b" * 64, b)
    path = a.segment.path
    a.segment.exported = True  # a caller mapped it: it is unlinked, not recycled
    assert tier.state.commit_blob("a" * 64, 0) is False  # already there
    tier.state.free_blob("a" * 64)
    tier._release_loc(a)
    assert os.path.exists(path)  # b still lives in it
    tier.state.free_blob("b" * 64)
    tier._release_loc(b)
    assert not os.path.exists(path)


def test_pack_is_all_or_nothing(tier: MemoryTier) -> None:
    with pytest.raises(ResourceExhausted):
        tier.allocate_pack([4 * MiB, 200 * MiB, 100 * MiB])  # the third does not fit in 256 MiB
    with pytest.raises(ResourceExhausted):  # fails on a chunk taken from the stock, still empty
        tier.allocate_pack([7 * MiB, 2 * MiB] + [4 * MiB] * 70)
    assert tier.state.reserved == 0
    assert not [p for p in os.listdir("/dev/shm") if p.startswith(tier.prefix + "-") and "-s-" not in p]


def test_tensors_larger_than_a_chunk_get_their_own_segment(tier: MemoryTier) -> None:
    locs = tier.allocate_pack([1 * MiB, 20 * MiB])
    assert locs[0].segment is not locs[1].segment and locs[1].offset == 0 and locs[1].segment.size == 20 * MiB


def test_stock_refill_stops_when_busy_and_learns_large_classes(tmp_path: object) -> None:
    stock = SegmentStock("/dev/shm", f"tc-test-{uuid.uuid4().hex[:8]}", 64 * MiB, chunk_bytes=16 * MiB)
    try:
        calls = iter([False, True])
        assert stock.refill(lambda: next(calls, True)) == 16 * MiB  # one chunk, then "busy"
        assert stock.refill() == 48 * MiB and stock.ready_bytes == 64 * MiB
        seg = stock.take(5 * MiB)  # a chunk cut down to size
        assert seg is not None and seg.size == 5 * MiB and os.stat(seg.path).st_size == 5 * MiB
        seg.unlink()
        seg.try_close()
        assert stock.take(20 * MiB) is None  # above a chunk: a miss that records demand for 32 MiB
        stock.refill()
        big = stock.take(20 * MiB)
        assert big is not None and big.size == 20 * MiB
        big.unlink()
        big.try_close()
    finally:
        stock.close()
