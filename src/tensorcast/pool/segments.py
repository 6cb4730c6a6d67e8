"""Shared-memory segments under /dev/shm: create (space reserved up front), map, unlink.

Owns: the OS side of the memory tier. A segment holds one tensor's bytes from offset 0. Creation reserves
the pages with ``posix_fallocate`` so a full /dev/shm is a clean ``ResourceExhausted`` at allocation, not a
SIGBUS in the middle of a copy, and so writers pay no first-touch faults. Deleting a segment unlinks its
name immediately but keeps the mapping until no reader still exports it; callers that mapped it
(copy-on-write) keep their pages: a segment's memory is never reused for other bytes.
Does not own: accounting or placement (``pool.state``).
"""

from __future__ import annotations

import contextlib
import errno
import glob
import logging
import mmap
import os
import uuid

from tensorcast.errors import NotFound, ResourceExhausted

__all__ = ["SHM_DIR", "Segment", "SegmentGone", "map_private", "map_shared", "remove_stale_segments"]

SHM_DIR = "/dev/shm"
log = logging.getLogger("tensorcast.pool")


class SegmentGone(NotFound):
    """A segment name cannot be opened here: deleted, or this process sees another /dev/shm."""


class Segment:
    """A named shared-memory region owned by this process (a worker)."""

    __slots__ = ("_mm", "_unlinked", "name", "readers", "size")

    def __init__(self, name: str, size: int, mm: mmap.mmap | None) -> None:
        self.name = name
        self.size = size
        self._mm = mm
        self.readers = 0
        self._unlinked = False

    @classmethod
    def create(cls, prefix: str, size: int) -> Segment:
        name = f"{prefix}-{uuid.uuid4().hex[:20]}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            if size:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    os.unlink(path)
                    if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                        raise ResourceExhausted(f"shared memory is full: cannot reserve {size} bytes") from None
                    raise
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            else:
                mm = None
        finally:
            os.close(fd)
        return cls(name, size, mm)

    def view(self) -> memoryview:
        if self._mm is None:
            return memoryview(b"")
        return memoryview(self._mm)

    def unlink(self) -> None:
        """Remove the name (new mappings become impossible); existing mappings stay valid."""
        if not self._unlinked:
            self._unlinked = True
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, self.name))

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


def _map(name: str, size: int, flags: int, prot: int) -> mmap.mmap:
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR if prot & mmap.PROT_WRITE and flags == mmap.MAP_SHARED else os.O_RDONLY)
    except FileNotFoundError:
        raise SegmentGone(f"shared-memory segment {name} is gone (deleted or on another host)") from None
    try:
        if os.fstat(fd).st_size < size:
            raise SegmentGone(f"shared-memory segment {name} is smaller than expected")
        return mmap.mmap(fd, size, flags=flags, prot=prot)
    finally:
        os.close(fd)


def map_private(name: str, size: int) -> mmap.mmap:
    """Copy-on-write mapping: the caller may write into it; the pool's bytes never change."""
    return _map(name, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)


def map_shared(name: str, size: int) -> mmap.mmap:
    """Writable shared mapping, used by a same-host writer to fill a segment the worker allocated."""
    return _map(name, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def remove_stale_segments(prefix: str) -> int:
    """Unlink segments a previous (crashed) process with this prefix left behind."""
    n = 0
    for path in glob.glob(os.path.join(SHM_DIR, glob.escape(prefix) + "-*")):
        try:
            os.unlink(path)
            n += 1
        except FileNotFoundError:
            pass
    if n:
        log.info("removed %d stale shared-memory segments with prefix %s", n, prefix)
    return n
