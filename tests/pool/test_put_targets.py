"""What a same-host put's writes rest on in the pool: ``write_at`` (``pwrite`` into a segment's targets)."""

from __future__ import annotations

import mmap
import os
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from tensorcast.pool.segments import SHM_DIR, Segment, SegmentGone, write_at

MiB = 1 << 20
PAGE = mmap.PAGESIZE


@pytest.fixture()
def segment() -> Iterator[Segment]:
    seg = Segment.create(SHM_DIR, f"tc-test-{uuid.uuid4().hex[:8]}", 3 * PAGE)
    yield seg
    seg.unlink()
    seg.try_close()


def test_write_at_fills_each_target_through_the_file(segment: Segment) -> None:
    a = np.arange(100, dtype=np.uint8)
    b = np.full(PAGE + 7, 9, np.uint8)
    write_at(segment.path, [(0, memoryview(a)), (PAGE, memoryview(b))])
    view = np.frombuffer(segment.view(), np.uint8)  # the worker's own mapping sees the bytes
    assert np.array_equal(view[:100], a) and np.array_equal(view[PAGE : 2 * PAGE + 7], b)
    assert not view[100:PAGE].any() and not view[2 * PAGE + 7 :].any()
    typed = np.arange(6, dtype=np.float32).reshape(2, 3)  # any contiguous buffer, written as its bytes
    write_at(segment.path, [(8, memoryview(typed))])
    assert np.array_equal(view[8:32].view(np.float32).reshape(2, 3), typed)


def test_write_at_writes_many_targets_back_to_back() -> None:
    seg = Segment.create(SHM_DIR, f"tc-test-{uuid.uuid4().hex[:8]}", 2100 * PAGE)
    try:
        pages = [np.full(PAGE, i % 251, np.uint8) for i in range(2000)]  # more than one pwritev takes
        writes = [(i * PAGE, memoryview(a)) for i, a in enumerate(pages)]
        writes.append((2050 * PAGE + 5, memoryview(b"tail")))  # apart from the others
        write_at(seg.path, writes[::-1])  # in any order
        view = np.frombuffer(seg.view(), np.uint8)
        assert all(np.array_equal(view[i * PAGE : (i + 1) * PAGE], a) for i, a in enumerate(pages))
        assert bytes(view[2050 * PAGE : 2050 * PAGE + 9]) == b"\0\0\0\0\0tail"
        assert not view[2000 * PAGE : 2050 * PAGE].any()
    finally:
        seg.unlink()
        seg.try_close()


def test_write_at_never_writes_past_the_end_of_a_segment(segment: Segment) -> None:
    with pytest.raises(SegmentGone):
        write_at(segment.path, [(3 * PAGE - 10, memoryview(b"x" * 11))])
    assert os.stat(segment.path).st_size == 3 * PAGE  # not extended
    assert not np.frombuffer(segment.view(), np.uint8).any()
    with pytest.raises(SegmentGone):
        write_at(segment.path + "-missing", [(0, memoryview(b"x"))])
