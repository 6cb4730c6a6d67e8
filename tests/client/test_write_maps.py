"""Same-host put targets written through kept mappings (``client.write_maps.SegmentWriter``): bytes land in the
file the worker reads, a mapping is reused while its file is the same one, and none outlives its file or its
idle time (a kept mapping also keeps the memory of a file the worker has freed)."""

from __future__ import annotations

import mmap
import os
import threading
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

import tensorcast as tc
from tensorcast.client.write_maps import SegmentWriter
from tensorcast.pool.segments import SHM_DIR, Segment, SegmentGone
from tensorcast.testing import running_cluster

PAGE = mmap.PAGESIZE


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def segment() -> Iterator[Segment]:
    seg = Segment.create(SHM_DIR, f"tc-test-{uuid.uuid4().hex[:8]}", 64 * PAGE)
    yield seg
    seg.unlink()
    seg.try_close()


def _file(path: str) -> np.ndarray:  # type: ignore[type-arg]
    with open(path, "rb") as f:
        return np.frombuffer(f.read(), np.uint8)


def test_bytes_land_in_the_segment_and_the_mapping_is_kept(segment: Segment) -> None:
    writer = SegmentWriter()
    a = np.arange(3 * PAGE + 5, dtype=np.uint32).view(np.uint8)[: 3 * PAGE + 5]
    typed = np.arange(6, dtype=np.float32).reshape(2, 3)  # any contiguous buffer, written as its bytes
    writer.write(segment.path, [(PAGE, memoryview(a)), (8, memoryview(typed)), (40 * PAGE, memoryview(b""))])
    view = np.frombuffer(segment.view(), np.uint8)  # the worker's own mapping sees the bytes
    assert np.array_equal(view[PAGE : 4 * PAGE + 5], a)
    assert np.array_equal(view[8:32].view(np.float32).reshape(2, 3), typed)
    assert not view[32:PAGE].any() and not view[4 * PAGE + 5 :].any()
    writer.write(segment.path, [(10 * PAGE, memoryview(b"again"))])  # pages written before and not
    writer.write(segment.path, [(PAGE, memoryview(b"over"))])
    assert bytes(view[10 * PAGE : 10 * PAGE + 5]) == b"again" and bytes(view[PAGE : PAGE + 4]) == b"over"
    assert writer.mapped == 1
    writer.close()
    assert writer.mapped == 0


def test_a_replaced_file_is_mapped_afresh(segment: Segment) -> None:
    writer = SegmentWriter()
    writer.write(segment.path, [(0, memoryview(b"old"))])
    os.unlink(segment.path)
    with open(segment.path, "wb") as f:  # the same path, another file (a restarted worker's)
        f.truncate(2 * PAGE)
    writer.write(segment.path, [(PAGE, memoryview(b"new"))])
    got = _file(segment.path)
    assert bytes(got[PAGE : PAGE + 3]) == b"new" and not got[:PAGE].any()
    assert bytes(np.frombuffer(segment.view(), np.uint8)[:3]) == b"old"  # the first file was never touched again
    assert writer.mapped == 1
    writer.close()


def test_a_missing_or_short_segment_is_refused_and_nothing_written(segment: Segment) -> None:
    writer = SegmentWriter()
    with pytest.raises(SegmentGone):
        writer.write(segment.path, [(64 * PAGE - 10, memoryview(b"x" * 11))])
    assert os.stat(segment.path).st_size == 64 * PAGE and not _file(segment.path).any()  # not extended
    writer.write(segment.path, [(0, memoryview(b"x"))])
    segment.shrink(2 * PAGE)  # the worker cut the file down: a kept mapping never writes past its end
    with pytest.raises(SegmentGone):
        writer.write(segment.path, [(3 * PAGE, memoryview(b"y"))])
    segment.unlink()
    with pytest.raises(SegmentGone):
        writer.write(segment.path, [(0, memoryview(b"x"))])
    assert writer.mapped == 0  # the mapping of a file that is gone is dropped at once


def test_mappings_go_when_idle_or_when_their_file_is_gone() -> None:
    clock = Clock()
    writer = SegmentWriter(idle_s=5.0, max_maps=2, clock=clock)
    segs = [Segment.create(SHM_DIR, f"tc-test-{uuid.uuid4().hex[:8]}", 4 * PAGE) for _ in range(3)]
    try:
        for seg in segs[:2]:
            writer.write(seg.path, [(0, memoryview(b"a"))])
        clock.now = 1.0
        writer.write(segs[2].path, [(0, memoryview(b"b"))])
        assert writer.mapped == 2  # at most max_maps: the least recently used went
        segs[2].unlink()  # the worker freed it: its memory must not stay mapped until the idle time is over
        writer.sweep()
        assert writer.mapped == 1
        clock.now = 4.9
        writer.sweep()
        assert writer.mapped == 1  # segs[1], idle for 4.9 s of 5
        clock.now = 5.0
        writer.sweep()
        assert writer.mapped == 0
    finally:
        for seg in segs:
            seg.unlink()
            seg.try_close()


def test_threads_write_one_segment_at_once(segment: Segment) -> None:
    writer = SegmentWriter()
    parts = [np.full(8 * PAGE, i + 1, np.uint8) for i in range(8)]
    threads = [threading.Thread(target=writer.write, args=(segment.path, [(i * 8 * PAGE, memoryview(p))]))
               for i, p in enumerate(parts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert np.array_equal(np.frombuffer(segment.view(), np.uint8), np.concatenate(parts))
    assert writer.mapped == 1
    writer.close()


def test_a_client_keeps_its_mappings_between_puts_and_lets_them_go_when_idle() -> None:
    idle = 0.5
    cfg = tc.Config.from_flat({"client.write_maps_idle_seconds": idle})
    with running_cluster(workers=1, memory_capacity="256MiB") as cluster, \
            tc.connect(cluster.address, config=cfg) as c:
        data = np.random.default_rng(3).integers(0, 255, 2 << 20, dtype=np.uint8)
        # Each put lands in the file the last one used (recycled) or, when that one was freed for good (a
        # reader mapped it), in a new one: then the mapping of the freed file goes at once. Never two.
        for i in range(4):
            data[:8] = i
            art = c.put(data)
            assert c.aio.writer.mapped == 1
            assert np.array_equal(art.tensor(like="numpy"), data)
            c.delete(art.id)
        # Unused, it goes within two idle times (a sweep runs idle_s after the last put, and again after that).
        deadline = time.monotonic() + 2 * idle + 5.0
        while c.aio.writer.mapped and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.aio.writer.mapped == 0
