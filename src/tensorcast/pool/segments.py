"""Memory-mapped files that hold tensor bytes: shared-memory segments and disk-tier files.

Owns: the OS side of both tiers. A segment is a file (under /dev/shm for the memory tier, under the disk
directory for the disk tier) mapped shared by the worker. Creation reserves its space with
``posix_fallocate``, so a full /dev/shm or disk is a clean ``ResourceExhausted`` at allocation and never
a SIGBUS mid-copy. ``SegmentStock`` keeps a budget of pre-faulted segments so that filling one on the hot
path pays no first-touch page faults. Deleting a segment unlinks its name immediately but keeps the
mapping until no reader in this process still uses it; callers that mapped it (copy-on-write) keep their
pages: a segment's memory is never reused for other bytes. Does not own: accounting (``pool.state``).
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

from tensorcast.errors import NotFound, ResourceExhausted

__all__ = ["SHM_DIR", "Segment", "SegmentGone", "SegmentStock", "map_private", "map_shared",
           "remove_stale_segments"]

SHM_DIR = "/dev/shm"
log = logging.getLogger("tensorcast.pool")
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class SegmentGone(NotFound):
    """A segment path cannot be opened here: deleted, or this process sees another filesystem."""


class Segment:
    """A mapped file owned by this process (a worker)."""

    __slots__ = ("_mm", "_unlinked", "path", "readers", "size")

    def __init__(self, path: str, size: int, mm: mmap.mmap | None) -> None:
        self.path = path
        self.size = size
        self._mm = mm
        self.readers = 0
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
        """Cut a (stock) segment down to ``size`` bytes; the tail pages are given back."""
        if size == self.size:
            return
        assert self._mm is not None and self.readers == 0
        self._mm.close()
        fd = os.open(self.path, os.O_RDWR)
        try:
            os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE,
                                 prot=mmap.PROT_READ | mmap.PROT_WRITE) if size else None
        finally:
            os.close(fd)
        self.size = size

    def view(self) -> memoryview:
        if self._mm is None:
            return memoryview(b"")
        return memoryview(self._mm)

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
    """Pre-faulted segments by power-of-two size class, refilled while the worker is idle, up to a budget.

    ``take(size)`` returns a ready segment of at least ``size`` bytes (shrunk to ``size``) or None on a
    miss; every request (hit or miss) records demand for its class, and ``refill()`` — called by the worker
    when no transfer or put is running, so pre-faulting never competes with the hot path for CPU — builds
    one segment per demanded class. A workload that keeps asking for similar sizes finds them ready.
    The stock is extra memory beyond the tier's capacity.
    """

    MIN_CLASS = 4 * 1024 * 1024

    def __init__(self, directory: str, prefix: str, budget: int) -> None:
        self.directory = directory
        self.prefix = prefix
        self.budget = budget
        self._lock = threading.Lock()
        self._stock: dict[int, list[Segment]] = {}
        self._bytes = 0
        self._closed = False
        self._wanted: dict[int, int] = {}  # class -> segments to keep ready

    @classmethod
    def size_class(cls, size: int) -> int:
        return max(cls.MIN_CLASS, 1 << (size - 1).bit_length())

    def take(self, size: int) -> Segment | None:
        if self.budget <= 0 or size < self.MIN_CLASS // 2:
            return None
        cls = self.size_class(size)
        with self._lock:
            self._wanted[cls] = max(self._wanted.get(cls, 0), 1)
            segs = self._stock.get(cls)
            seg = segs.pop() if segs else None
            if seg is not None:
                self._bytes -= seg.size
        if seg is not None:
            seg.shrink(size)
        return seg

    def refill(self) -> int:
        """Pre-fault segments for demanded classes within the budget (blocking); returns bytes added."""
        added = 0
        for cls, want in sorted(self._wanted.items()):
            while True:
                with self._lock:
                    have = len(self._stock.get(cls, ()))
                    if self._closed or have >= want or self._bytes + cls > self.budget:
                        break
                try:
                    seg = Segment.create(self.directory, self.prefix, cls, populate=True)
                except Exception as exc:
                    log.debug("prefault of %d bytes failed: %s", cls, exc)
                    return added
                with self._lock:
                    if self._closed:
                        seg.unlink()
                        seg.try_close()
                        return added
                    self._stock.setdefault(cls, []).append(seg)
                    self._bytes += cls
                added += cls
        return added

    def close(self) -> None:
        with self._lock:
            self._closed = True
            segs = [s for ss in self._stock.values() for s in ss]
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


def map_private(path: str, size: int, offset: int = 0) -> mmap.mmap | memoryview:
    """Copy-on-write mapping: the caller may write into it; the pool's bytes never change. With an
    ``offset`` (a tensor inside a checkpoint file), the mapping starts at the page below it and the
    returned memoryview covers exactly ``[offset, offset + size)`` (it keeps the mapping alive)."""
    if offset == 0:
        return _map(path, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
    base = offset - offset % mmap.ALLOCATIONGRANULARITY
    mm = _map(path, size + offset - base, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE, offset=base)
    return memoryview(mm)[offset - base : offset - base + size]


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
