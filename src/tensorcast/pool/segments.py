"""Memory-mapped files that hold tensor bytes: shared-memory segments and disk-tier files.

Owns: the OS side of both tiers. A segment is a file (under /dev/shm for the memory tier, under the disk
directory for the disk tier) mapped shared by the worker. Creation reserves its space with
``posix_fallocate``, so a full /dev/shm or disk is a clean ``ResourceExhausted`` at allocation and never
a SIGBUS mid-copy; ``Segment.prefault`` maps its pages in ahead of use, a step at a time.
Same-host writers fill their targets with ``write_at`` (``pwrite``: no mapping, no page faults of their
own). Deleting a segment unlinks its name immediately but keeps the mapping until no reader in this process
still uses it; callers that mapped it (copy-on-write) keep their pages: a segment's memory is never
reused for other bytes. Does not own: accounting (``pool.state``), keeping pre-faulted segments ready
(``pool.stock``).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import glob
import logging
import mmap
import os
import uuid
from collections.abc import Callable, Sequence

from tensorcast.errors import NotFound, ResourceExhausted

__all__ = ["SHM_DIR", "Segment", "SegmentGone", "map_private", "map_shared", "populate_read",
           "remove_stale_segments", "write_at"]

SHM_DIR = "/dev/shm"
log = logging.getLogger("tensorcast.pool")
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14; older kernels refuse it (EINVAL)
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
# Pages are faulted in steps of this many bytes: each step holds the process's mmap lock only briefly, so
# the event loop (which maps and unmaps memory too) never waits long behind the pre-faulting thread.
_PREFAULT_STEP = 2 * 1024 * 1024
_IOV_MAX = 1024  # buffers one pwritev takes (Linux's IOV_MAX)
# ctypes calls release the GIL: the event loop runs on while a page-populating call is in the kernel.
_LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


class SegmentGone(NotFound):
    """A segment path cannot be opened here: deleted, or this process sees another filesystem."""


class Segment:
    """A mapped file owned by this process (a worker)."""

    __slots__ = ("_mm", "_unlinked", "blobs", "exported", "path", "readers", "size")

    def __init__(self, path: str, size: int, mm: mmap.mmap | None) -> None:
        self.path = path
        self.size = size
        self._mm = mm
        self.readers = 0
        self.blobs = 1  # blobs living in it: a pack segment holds several, and goes with the last one
        # Its name was handed to a caller, who may have mapped it: its pages may never hold other bytes.
        self.exported = False
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
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        seg = cls(path, size, mm)
        if populate:
            seg.prefault()
        return seg

    def prefault(self, stop: Callable[[], bool] = lambda: False) -> bool:
        """Map every page in now (writable), a step at a time, so that filling the segment later pays no
        page faults (here a fault costs more than copying the page). Stops early when ``stop()`` says so;
        True when every page is in. Only for a segment no other thread uses yet (its address is used
        without a buffer export). Each step runs without the GIL (``mmap.madvise`` would hold it) and holds
        the process's mmap lock for one step only; older kernels without MADV_POPULATE_WRITE: one touch per
        page."""
        if self._mm is None:
            return True
        holder = ctypes.c_char.from_buffer(self._mm)
        base = ctypes.addressof(holder)
        del holder  # the mapping stays; only the export is dropped, so the segment can still be closed
        for start in range(0, self.size, _PREFAULT_STEP):
            if stop():
                return False
            length = min(_PREFAULT_STEP, self.size - start)
            if _LIBC.madvise(ctypes.c_void_p(base + start), ctypes.c_size_t(length), _POPULATE_WRITE) != 0:
                view = memoryview(self._mm)[start : start + length]
                view[:: mmap.PAGESIZE] = bytes(-(-length // mmap.PAGESIZE))
        return True

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


def populate_read(address: int, nbytes: int) -> None:
    """Map in now the pages of ``nbytes`` at ``address`` (inside a mapping the caller keeps alive), for
    reading: a copy out of them later pays no page fault per 4 KiB page. Without the GIL and a step at a
    time (as ``Segment.prefault``); best effort (older kernels refuse it, and the copy faults as before)."""
    start = address - address % mmap.PAGESIZE
    end = address + nbytes
    for step in range(start, end, _PREFAULT_STEP):
        if _LIBC.madvise(ctypes.c_void_p(step), ctypes.c_size_t(min(_PREFAULT_STEP, end - step)), _POPULATE_READ):
            return


def map_shared(path: str, size: int) -> mmap.mmap:
    """Writable shared mapping, used by a same-host writer to fill a segment the worker allocated."""
    return _map(path, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def write_at(path: str, writes: Sequence[tuple[int, memoryview]]) -> None:
    """Copy each ``(offset, bytes)`` into the file at ``path`` (a same-host writer filling the targets a worker
    allocated for it, e.g. the blobs of one put side by side in a pack chunk) with ``pwrite``: the kernel
    copies straight into the file's pages. Mapping the file instead costs a page fault (or a populate step)
    per 4 KiB page plus an unmap, which together cost more than the copy; and ``pwrite`` writes into pages
    that were only reserved (``posix_fallocate``) as fast as into pre-faulted ones. Targets that follow one
    another without a gap (a pack's page-sized tensors) go in one ``pwritev``: a syscall per small tensor
    would cost more than its bytes. Never writes past the end of the file: a file shorter than a target
    raises ``SegmentGone``, like a missing one."""
    try:
        fd = os.open(path, os.O_WRONLY)
    except (FileNotFoundError, PermissionError):
        raise SegmentGone(f"segment {path} is gone (deleted, or on another host)") from None
    try:
        size = os.fstat(fd).st_size
        runs: list[tuple[int, list[memoryview]]] = []  # (offset, buffers back to back)
        end = -1
        for offset, data in sorted(writes, key=lambda w: w[0]):
            view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
            if offset < 0 or offset + len(view) > size:
                raise SegmentGone(f"segment {path} is smaller than expected")
            if runs and offset == end:
                runs[-1][1].append(view)
            else:
                runs.append((offset, [view]))
            end = offset + len(view)
        for offset, views in runs:
            _pwrite_all(fd, views, offset)
    finally:
        os.close(fd)


def _pwrite_all(fd: int, views: list[memoryview], offset: int) -> None:
    """Write ``views`` back to back from ``offset``, up to IOV_MAX buffers a call, resuming partial writes."""
    views = [v for v in views if len(v)]
    while views:
        batch = views[:_IOV_MAX]
        n = os.pwritev(fd, batch, offset) if len(batch) > 1 else os.pwrite(fd, batch[0], offset)
        offset += n
        done = 0
        while done < len(batch) and n >= len(batch[done]):
            n -= len(batch[done])
            done += 1
        views = views[done:]
        if n:
            views[0] = views[0][n:]


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
