"""Memory-mapped files that hold tensor bytes: shared-memory segments and disk-tier files.

Owns: the OS side of both tiers. A segment is a file (under /dev/shm for the memory tier, under the disk
directory for the disk tier) mapped shared by the worker. Creation reserves its space with
``posix_fallocate``, so a full /dev/shm or disk is a clean ``ResourceExhausted`` at allocation and never
a SIGBUS mid-copy. ``SegmentStock`` keeps a budget of pre-faulted segments so that filling one on the hot
path pays no first-touch page faults (here first touch costs about as much as the copy itself).
Deleting a segment unlinks its name immediately but keeps the mapping until no reader in this process
still uses it; callers that mapped it (copy-on-write) keep their pages: a segment's memory is never
reused for other bytes. Does not own: accounting (``pool.state``).
"""

from __future__ import annotations

import contextlib
import errno
import glob
import logging
import mmap
import os
import threading
import uuid
from collections.abc import Callable, Sequence

from tensorcast.errors import NotFound, ResourceExhausted

__all__ = ["SHM_DIR", "Segment", "SegmentGone", "SegmentStock", "map_private", "map_shared",
           "remove_stale_segments"]

SHM_DIR = "/dev/shm"
log = logging.getLogger("tensorcast.pool")
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14; older kernels refuse it (EINVAL)


class SegmentGone(NotFound):
    """A segment path cannot be opened here: deleted, or this process sees another filesystem."""


class Segment:
    """A mapped file owned by this process (a worker)."""

    __slots__ = ("_mm", "_unlinked", "blobs", "path", "readers", "size")

    def __init__(self, path: str, size: int, mm: mmap.mmap | None) -> None:
        self.path = path
        self.size = size
        self._mm = mm
        self.readers = 0
        self.blobs = 1  # blobs living in it: a pack segment holds several, and goes with the last one
        self._unlinked = False

    @classmethod
    def create(cls, directory: str, prefix: str, size: int, *, populate: bool = False) -> Segment:
        path = os.path.join(directory, f"{prefix}-{uuid.uuid4().hex[:20]}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            mm = None
            if size:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    os.unlink(path)
                    if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT):
                        raise ResourceExhausted(f"{directory} is full: cannot reserve {size} bytes") from None
                    raise
                flags = mmap.MAP_SHARED | (_POPULATE if populate else 0)
                mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(path, size, mm)

    @classmethod
    def open_existing(cls, path: str, writable: bool = False) -> Segment:
        """Map a file that already holds bytes (a disk-tier blob) read-only."""
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot) if size else None
        finally:
            os.close(fd)
        return cls(path, size, mm)

    def shrink(self, size: int) -> None:
        """Cut a (stock) segment down to ``size`` bytes; the tail pages are given back. The mapping keeps its
        length (unmapping and re-mapping a populated segment costs more than the shrink saves), but
        ``view()`` covers ``size`` bytes only, so nothing here touches the tail."""
        if size == self.size or self._mm is None:  # closed meanwhile (retired): nothing to give back
            return
        assert 0 < size < self.size
        os.truncate(self.path, size)
        self.size = size

    def view(self) -> memoryview:
        if self._mm is None:
            return memoryview(b"")
        return memoryview(self._mm)[: self.size]

    def populate(self, offset: int, length: int) -> None:
        """Map a range of pages in now, in one call (a strided copy out of a mapped file would otherwise
        take a page fault per 4 KiB page, which costs more than the copy). Best effort."""
        if self._mm is None or length <= 0:
            return
        start = offset - offset % mmap.PAGESIZE
        with contextlib.suppress(OSError, ValueError):
            self._mm.madvise(_POPULATE_READ, start, min(self.size, offset + length) - start)

    def flush(self) -> None:
        """Write dirty pages to the file (disk tier durability)."""
        if self._mm is not None:
            self._mm.flush()

    def rename(self, path: str) -> None:
        os.replace(self.path, path)
        self.path = path

    def unlink(self) -> None:
        """Remove the name (new mappings become impossible); existing mappings stay valid."""
        if not self._unlinked:
            self._unlinked = True
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def try_close(self) -> bool:
        """Unmap if nobody in this process still reads from it; True when closed."""
        if self.readers > 0:
            return False
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a memoryview of it is still alive (e.g. a send in progress)
                return False
            self._mm = None
        return True


class SegmentStock:
    """Pre-faulted segments, built while the worker is idle, up to a byte budget.

    Two kinds, so that both a burst of many tensors and repeated large puts find memory ready:
    - **chunks** of ``chunk_bytes``: the budget left after the demanded classes is kept full of them.
      ``take_chunk()`` hands one out whole (a pack allocation carves many tensors out of it);
      ``take(size)`` for ``size <= chunk_bytes`` cuts one down to ``size`` (the tail pages go back).
    - **size classes** (powers of two) for objects larger than a chunk: every miss records demand for its
      class and ``refill()`` builds one segment per demanded class (first), so that a workload that keeps
      putting similar large tensors finds one ready.

    ``refill(busy)`` builds one segment at a time and stops as soon as ``busy()`` says the hot path needs
    the CPU again. The stock is extra memory beyond the tier's capacity; its size is a worker signal.
    """

    MIN_CLASS = 4 * 1024 * 1024

    def __init__(self, directory: str, prefix: str, budget: int, chunk_bytes: int = 256 * 1024 * 1024) -> None:
        self.directory = directory
        self.prefix = prefix
        self.budget = budget
        self.chunk_bytes = max(self.MIN_CLASS, min(chunk_bytes, budget)) if budget > 0 else chunk_bytes
        self._lock = threading.Lock()
        self._chunks: list[Segment] = []
        self._stock: dict[int, list[Segment]] = {}
        self._bytes = 0
        self._closed = False
        self._wanted: set[int] = set()  # classes above the chunk size to keep one segment ready of

    @property
    def ready_bytes(self) -> int:
        return self._bytes

    @classmethod
    def size_class(cls, size: int) -> int:
        return max(cls.MIN_CLASS, 1 << (size - 1).bit_length())

    def take_chunk(self) -> Segment | None:
        """A whole pre-faulted chunk (``chunk_bytes``), or None."""
        with self._lock:
            if not self._chunks:
                return None
            seg = self._chunks.pop()
            self._bytes -= seg.size
            return seg

    def take(self, size: int) -> Segment | None:
        """A pre-faulted segment of exactly ``size`` bytes, or None on a miss."""
        if self.budget <= 0 or size < self.MIN_CLASS // 2:
            return None
        if size <= self.chunk_bytes:
            seg = self.take_chunk()
        else:
            cls = self.size_class(size)
            with self._lock:
                self._wanted.add(cls)
                segs = self._stock.get(cls)
                seg = segs.pop() if segs else None
                if seg is not None:
                    self._bytes -= seg.size
        if seg is not None:
            seg.shrink(size)
        return seg

    def _next_build(self) -> tuple[int, list[Segment], list[Segment]] | None:
        """What to pre-fault next (size, list to add it to, chunks to give up for it), or None when full.
        A demanded class comes first: chunks make room for it."""
        with self._lock:
            if self._closed:
                return None
            for cls in sorted(self._wanted):
                if self._stock.get(cls) or cls > self.budget:
                    continue
                dropped = []
                while self._bytes + cls > self.budget and self._chunks:
                    dropped.append(self._chunks.pop())
                    self._bytes -= dropped[-1].size
                if self._bytes + cls <= self.budget:
                    return cls, self._stock.setdefault(cls, []), dropped
                self._chunks += dropped
                self._bytes += sum(s.size for s in dropped)
            if self._bytes + self.chunk_bytes <= self.budget:
                return self.chunk_bytes, self._chunks, []
            return None

    def refill(self, busy: Callable[[], bool] = lambda: False) -> int:
        """Pre-fault segments until the budget is used or ``busy()`` (blocking); returns bytes added."""
        added = 0
        while not busy() and (job := self._next_build()) is not None:
            size, into, dropped = job
            for seg in dropped:
                seg.unlink()
                seg.try_close()
            try:
                seg = Segment.create(self.directory, self.prefix, size, populate=True)
            except Exception as exc:  # a full /dev/shm: the stock is an optimisation, never an error
                log.debug("prefault of %d bytes failed: %s", size, exc)
                return added
            with self._lock:
                if not self._closed:
                    into.append(seg)
                    self._bytes += size
                    added += size
                    continue
            seg.unlink()
            seg.try_close()
            return added
        return added

    def close(self) -> None:
        with self._lock:
            self._closed = True
            segs = self._chunks + [s for ss in self._stock.values() for s in ss]
            self._chunks = []
            self._stock.clear()
            self._bytes = 0
        for s in segs:
            s.unlink()
            s.try_close()


def _map(path: str, size: int, flags: int, prot: int, offset: int = 0) -> mmap.mmap:
    try:
        fd = os.open(path, os.O_RDWR if flags == mmap.MAP_SHARED else os.O_RDONLY)
    except (FileNotFoundError, PermissionError):
        raise SegmentGone(f"segment {path} is gone (deleted, or on another host)") from None
    try:
        if os.fstat(fd).st_size < offset + size:  # offset: where the mapping starts
            raise SegmentGone(f"segment {path} is smaller than expected")
        return mmap.mmap(fd, size, flags=flags, prot=prot, offset=offset)
    finally:
        os.close(fd)


def map_private(path: str, spans: Sequence[tuple[int, int]]) -> list[memoryview]:
    """Copy-on-write views of ``(offset, size)`` byte ranges of one file: the caller may write into them;
    the pool's bytes never change. One mapping serves them all (from the page below the first range to
    the end of the last): the tensors of a pack, or of a checkpoint file, cost one ``mmap`` rather than
    one each. The views keep the mapping alive."""
    base = min((o for o, _ in spans), default=0)
    base -= base % mmap.ALLOCATIONGRANULARITY
    end = max((o + n for o, n in spans), default=base)
    if end == base:
        return [memoryview(b"") for _ in spans]
    whole = memoryview(_map(path, end - base, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE, offset=base))
    return [whole[o - base : o - base + n] for o, n in spans]


def map_shared(path: str, size: int) -> mmap.mmap:
    """Writable shared mapping, used by a same-host writer to fill a segment the worker allocated."""
    return _map(path, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def remove_stale_segments(prefix: str, directory: str = SHM_DIR) -> int:
    """Unlink segments a previous (crashed) process with this prefix left behind."""
    n = 0
    for path in glob.glob(os.path.join(directory, glob.escape(prefix) + "-*")):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            n += 1
    if n:
        log.info("removed %d stale segments with prefix %s in %s", n, prefix, directory)
    return n
