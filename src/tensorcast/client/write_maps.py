"""Same-host put targets written through mappings this process keeps between puts.

Owns: ``SegmentWriter``, the writable shared mappings of the worker's memory segments that same-host puts
fill (the pack chunks of its pre-faulted stock), kept from one put to the next. A chunk whose blobs are all
deleted goes back to the worker's stock, file and pages alone (``pool.stock.SegmentStock.recycle``), and
the next puts are carved out of it again: through a mapping kept here, their bytes are one ``memcpy`` into
pages this process has faulted in already. ``pwrite`` into the same pages costs 2-3x more (the kernel looks
up and locks every page), and mapping the chunk afresh for each put costs a fault per 4 KiB page, which is
more than the copy. Pages not written through a mapping yet are faulted in by one ``MADV_POPULATE_WRITE``
per target (a fault per page costs several times more).

A kept mapping also keeps its file's memory, even once the worker unlinked it: so every mapping goes after
``idle_s`` without a write, and once its path is gone or names another file (checked whenever a put maps a new file,
and by a sweep ``idle_s`` after a put), and at most ``max_maps`` are kept. A file shorter than a target raises
``SegmentGone`` (nothing is written past its end). The file's size is checked once per put: a worker cuts a file
holding a put's targets short only after reclaiming the put as abandoned (``worker.put_timeout``, minutes), and a
copy into a mapping past the end of its file would be a SIGBUS where ``pwrite`` fails cleanly.

Does not own: which targets a put gets (``worker.puts``), disk-tier targets (written with
``pool.segments.write_at``), or reading (``client.reads``).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tensorcast.pool.segments import SegmentGone

__all__ = ["SegmentWriter"]

_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)  # calls release the GIL
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14; older kernels: faults as written
_PAGE = mmap.PAGESIZE


@dataclass
class _Map:
    """One file mapped whole: its identity (device, inode), base address and which pages this process has
    faulted in (a hint only: a page faulted out meanwhile is faulted in again by the copy)."""

    mm: mmap.mmap
    dev: int
    ino: int
    size: int
    base: int
    faulted: np.ndarray  # one bool per page
    users: int = 0
    last_used: float = field(default_factory=time.monotonic)


class SegmentWriter:
    """Writes same-host put targets through kept mappings. Thread-safe: puts write on worker threads."""

    def __init__(self, idle_s: float = 5.0, max_maps: int = 16,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_s, self.max_maps, self._clock = idle_s, max_maps, clock
        self._lock = threading.Lock()
        self._maps: dict[str, _Map] = {}
        self._armed = False  # a sweep is scheduled

    def write(self, path: str, writes: Sequence[tuple[int, memoryview]]) -> None:
        """Copy each ``(offset, bytes)`` into the memory segment at ``path``; ``SegmentGone`` if it is missing or
        shorter than a target (then nothing past its end is written)."""
        m = self._acquire(path, max((off + v.nbytes for off, v in writes), default=0))
        try:
            for offset, data in writes:
                src = np.frombuffer(data, np.uint8) if data.nbytes else None
                if src is None:
                    continue
                first, last = offset // _PAGE, -(-(offset + src.size) // _PAGE)
                if not m.faulted[first:last].all():
                    start = first * _PAGE
                    _LIBC.madvise(ctypes.c_void_p(m.base + start), ctypes.c_size_t(last * _PAGE - start),
                                  _POPULATE_WRITE)  # best effort: EINVAL on an old kernel, then the copy faults
                    m.faulted[first:last] = True
                ctypes.memmove(m.base + offset, src.ctypes.data, src.size)
        finally:
            with self._lock:
                m.users -= 1
                m.last_used = self._clock()

    def _acquire(self, path: str, end: int) -> _Map:
        """The mapping of ``path`` as it is now (mapped afresh if the file changed), marked in use; the file must
        hold ``end`` bytes."""
        try:
            st = os.stat(path)
        except (FileNotFoundError, PermissionError, NotADirectoryError):
            self._drop(path)
            raise SegmentGone(f"segment {path} is gone (deleted, or on another host)") from None
        if end > st.st_size:
            raise SegmentGone(f"segment {path} is smaller than expected")
        with self._lock:
            m = self._maps.get(path)
            if m is not None and (m.dev, m.ino) == (st.st_dev, st.st_ino) and end <= m.size:
                m.users += 1
                return m
        fresh = self._map(path, st.st_size)
        self._drop_gone()  # a put into a new file: its predecessor may be gone (freed after a reader mapped it)
        with self._lock:
            old = self._maps.get(path)
            self._maps[path] = fresh
            fresh.users += 1
            self._close_idle(now=self._clock(), also=old)
        return fresh

    @staticmethod
    def _map(path: str, size: int) -> _Map:
        try:
            fd = os.open(path, os.O_RDWR)
        except (FileNotFoundError, PermissionError):
            raise SegmentGone(f"segment {path} is gone (deleted, or on another host)") from None
        try:
            st = os.fstat(fd)
            if st.st_size < size:
                raise SegmentGone(f"segment {path} is smaller than expected")
            mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        holder = ctypes.c_char.from_buffer(mm)
        base = ctypes.addressof(holder)
        del holder  # only the address is kept: the mapping can still be closed
        return _Map(mm, st.st_dev, st.st_ino, st.st_size, base, np.zeros(-(-st.st_size // _PAGE), bool))

    def _drop(self, path: str) -> None:
        with self._lock:
            m = self._maps.pop(path, None)
            if m is not None:
                self._close_idle(now=self._clock(), also=m)

    def _close_idle(self, now: float, also: _Map | None = None) -> None:
        """With the lock held: close ``also`` (replaced or gone) and every mapping idle for ``idle_s``, and the
        least recently used idle ones beyond ``max_maps``. A mapping in use is closed by its last user."""
        doomed = [also] if also is not None and also.users == 0 else []
        idle = sorted((m.last_used, p) for p, m in self._maps.items() if m.users == 0)
        over = len(self._maps) - self.max_maps
        for k, (last_used, path) in enumerate(idle):
            if k < over or now - last_used >= self.idle_s:
                doomed.append(self._maps.pop(path))
        for m in doomed:
            m.mm.close()

    def sweep(self) -> None:
        """Close the mappings idle for ``idle_s`` and those whose file is gone or was replaced (their memory
        would otherwise outlive the worker's use of it)."""
        self._drop_gone()
        with self._lock:
            self._close_idle(now=self._clock())

    def _drop_gone(self) -> None:
        """Close the unused mappings whose file is gone or was replaced (a ``stat`` each)."""
        with self._lock:
            paths = [(p, m.dev, m.ino) for p, m in self._maps.items() if m.users == 0]
        for path, dev, ino in paths:
            try:
                st = os.stat(path)
                gone = (st.st_dev, st.st_ino) != (dev, ino)
            except OSError:
                gone = True
            if gone:
                with self._lock:
                    m = self._maps.get(path)
                    if m is not None and m.users == 0 and (m.dev, m.ino) == (dev, ino):
                        m.mm.close()
                        del self._maps[path]

    def schedule_sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        """Sweep on ``loop`` ``idle_s`` from now, and again after that while mappings are kept (one timer at a
        time): an idle client keeps no mapping for longer than twice ``idle_s``."""
        with self._lock:
            if self._armed or not self._maps:
                return
            self._armed = True
        loop.call_later(self.idle_s, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            self._armed = False
        self.sweep()
        self.schedule_sweep(loop)

    @property
    def mapped(self) -> int:
        """How many mappings are kept."""
        with self._lock:
            return len(self._maps)

    def close(self) -> None:
        with self._lock:
            for m in self._maps.values():
                if m.users == 0:
                    m.mm.close()
            self._maps.clear()
