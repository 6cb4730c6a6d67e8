"""The memory tier's pack chunks: where the blobs of one batch are carved, page-aligned, out of large segments.

Owns: placing a batch's blobs into chunks (best fit decreasing: the batch takes as few chunks as it can,
taking pre-faulted or recycled ones from the stock first, fresh segments once it is empty), the *open* chunk
that the next batch continues in, and the unused tails of the other chunks, given back later by ``trim``
(which chunks are being cut right now, so none of them is recycled meanwhile). Does not own: the blobs
placed, the capacity they are charged to, or what becomes of a chunk whose last blob went (``pool.memory``);
the stock itself (``pool.stock``).
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import threading
from collections.abc import Callable

from tensorcast.pool.segments import SHM_DIR, Segment
from tensorcast.pool.stock import SegmentStock

__all__ = ["Chunks", "PackChunks", "pages"]

_PAGE = mmap.PAGESIZE  # blobs in a pack start on a page: callers map each one on its own
# A chunk stays open for the next batch only with at least this much room left.
_MIN_OPEN_ROOM = 1024 * 1024

Chunks = list[tuple[Segment, list[int]]]  # (chunk, [bytes used]) of one batch; the open one first, if any


def pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages: the room a blob takes in a pack."""
    return -(-nbytes // _PAGE) * _PAGE


class PackChunks:
    """The chunks of ``MemoryTier.allocate_pack``. ``retire(segment)`` is the tier's: a chunk's last blob is
    gone. ``lock`` is the tier's; the methods that take no lock run with it held."""

    def __init__(self, lock: threading.RLock, stock: SegmentStock, prefix: str,
                 retire: Callable[[Segment], None]) -> None:
        self.lock = lock
        self.stock = stock
        self.prefix = prefix
        self.retire = retire
        self.open: tuple[Segment, int] | None = None  # the chunk the next pack continues in, and its bytes used
        self.untrimmed: list[tuple[Segment, int]] = []  # pack chunks and the bytes they use
        self.trimming: set[int] = set()  # ids of chunks being cut down right now

    def take_open(self) -> tuple[Segment, int] | None:
        """The open chunk and its bytes used, for this batch alone until it is handed back (``keep_open``)."""
        with self.lock:
            opened, self.open = self.open, None
        return opened

    def place(self, sizes: list[int], chunks: Chunks, put: Callable[[int, Segment, int], None]) -> None:
        """Best fit decreasing of the blobs that fit a chunk into ``chunks``, taking more as needed.
        ``put(i, chunk, offset)`` records blob ``i`` (and may refuse it by raising)."""
        chunk_bytes = self.stock.chunk_bytes
        order = sorted((k for k in range(len(sizes)) if 0 < sizes[k] <= chunk_bytes), key=lambda k: -sizes[k])
        left = sum(pages(sizes[k]) for k in order)  # bytes still to place
        room = sorted((seg.size - used[0], k) for k, (seg, used) in enumerate(chunks))  # best fit by bisection
        for i in order:
            size = sizes[i]
            at = bisect.bisect_left(room, (pages(size), -1))
            if at < len(room):
                k = room.pop(at)[1]
            else:
                # Recycled or pre-faulted memory from the stock; once it is empty, a fresh segment for the
                # rest (faulted in as it is filled): small tensors stay in a pack, where callers can map
                # them, not in arena slots.
                seg = self.stock.take_for_pack(pages(size)) or \
                    Segment.create(SHM_DIR, self.prefix, min(chunk_bytes, left))
                seg.blobs = 0
                k = len(chunks)
                chunks.append((seg, [0]))
            seg, used = chunks[k]
            put(i, seg, used[0])
            seg.blobs += 1
            used[0] += pages(size)
            left -= pages(size)
            if used[0] < seg.size:
                bisect.insort(room, (seg.size - used[0], k))

    def give_up(self, chunks: Chunks, opened: tuple[Segment, int] | None) -> None:
        """A batch failed (its blobs were discarded): the open chunk (``opened``, as ``take_open`` gave it) is
        handed back, and chunks taken from the stock that hold nothing are retired (with the lock held)."""
        for k, (seg, _) in enumerate(chunks):
            if k == 0 and opened is not None:
                self.hand_back_open(seg, opened[1])  # nothing of this batch stays in it
            elif seg.blobs == 0:
                self.retire(seg)  # taken from the stock, nothing placed in it yet

    def keep_open(self, chunks: Chunks, had_open: bool) -> None:
        """After a batch: the chunk with the most room left stays open for the next one; the others' tails
        wait for ``trim()``. An open chunk holds one reference of its own, so it outlives its blobs."""
        with self.lock:
            best = max(range(len(chunks)), key=lambda k: chunks[k][0].size - chunks[k][1][0], default=-1)
            for k, (seg, used) in enumerate(chunks):
                was_open = had_open and k == 0
                if k == best and seg.size - used[0] >= _MIN_OPEN_ROOM:
                    if not was_open:
                        seg.blobs += 1
                    self.hand_back_open(seg, used[0])
                elif was_open:
                    self.close_open(seg, used[0])
                elif used[0] < seg.size:
                    self.untrimmed.append((seg, used[0]))

    def hand_back_open(self, seg: Segment, used: int) -> None:
        """Make ``seg`` the open chunk; if another batch set one meanwhile, the one with less room left is
        closed."""
        if self.open is not None:
            other, other_used = self.open
            if other.size - other_used >= seg.size - used:
                self.close_open(seg, used)
                return
            self.close_open(other, other_used)
        self.open = (seg, used)

    def close_open(self, seg: Segment, used: int) -> None:
        """A chunk stops being open: without blobs it goes (back to the stock, whole), else its tail waits
        for ``trim()``."""
        seg.blobs -= 1
        if seg.blobs <= 0:
            self.retire(seg)
        elif used < seg.size:
            self.untrimmed.append((seg, used))

    def open_room(self) -> int:
        with self.lock:
            return self.open[0].size - self.open[1] if self.open is not None else 0

    def recyclable(self, segment: Segment) -> bool:
        """Whether a chunk whose last blob went may go back to the stock now (not while being cut)."""
        return id(segment) not in self.trimming

    def recycled(self, segment: Segment) -> None:
        """A chunk went back to the stock whole: its tail is no longer to be trimmed."""
        self.untrimmed = [(s, used) for s, used in self.untrimmed if s is not segment]

    def trim(self) -> int:
        """Give back the unused tail pages of the chunks that packs were carved from; returns the bytes
        given back. Blocking (call it off the event loop, when the hot path is done)."""
        with self.lock:
            todo, self.untrimmed = self.untrimmed, []
            self.trimming.update(id(seg) for seg, _ in todo)  # not recycled while being cut
        freed = 0
        for seg, used in todo:
            try:
                with self.lock:
                    if seg.blobs <= 0:  # retired meanwhile: its pages are gone with it
                        continue
                with contextlib.suppress(FileNotFoundError):
                    before = seg.size
                    seg.shrink(used)
                    freed += before - used
            finally:
                with self.lock:
                    self.trimming.discard(id(seg))
        return freed
