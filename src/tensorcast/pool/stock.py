"""Pre-faulted shared-memory segments kept ready for the memory tier, up to a byte budget.

Owns: ``SegmentStock``: which segments are ready (whole chunks, segments of the size classes that large puts
asked for, and recycled memory that no caller was ever given), building them off the hot path a step at a
time (``refill``, stopping when ``busy()`` says so), handing them out for one blob or a pack, and taking back
freed memory with its faulted pages. Filling a ready segment pays no first-touch page faults (here first
touch costs about as much as the copy itself). Does not own: creating, faulting in and unmapping one segment
(``pool.segments.Segment``), or which blobs live in the segments it hands out (``pool.memory``).
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Callable

from tensorcast.pool.segments import Segment

__all__ = ["SegmentStock"]

log = logging.getLogger("tensorcast.pool")


def _size(seg: Segment) -> int:
    return seg.size


class SegmentStock:
    """Pre-faulted segments, ready to be filled without first-touch page faults, up to a byte budget.

    Three kinds, so that a burst of many tensors, repeated large puts and a steady stream of transfers all
    find memory ready:
    - **chunks** of ``chunk_bytes``: the budget left after the demanded classes is kept full of them.
      ``take_chunk()`` hands one out whole (a pack allocation carves many tensors out of it);
      ``take(size)`` for ``size <= chunk_bytes`` cuts one down to ``size`` (the tail pages go back).
    - **size classes** (powers of two) for objects larger than a chunk: every miss records demand for its
      class and ``refill()`` builds one segment per demanded class (first), so that a workload that keeps
      putting similar large tensors finds one ready.
    - **recycled** segments (``recycle``): memory whose bytes were freed and that no caller was ever given
      (so nobody can have it mapped: the zero-copy invariant holds) keeps its faulted pages and serves the
      next allocation of a similar size. Sustained transfers then never wait for first touch.

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
        self._recycled: list[Segment] = []  # sorted by size
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

    def take_for_pack(self, size: int) -> Segment | None:
        """A pre-faulted segment to carve a batch of blobs out of, with room for at least ``size`` bytes: the
        smallest recycled one that fits, else a chunk; None when the stock has neither."""
        seg = self._take_recycled(size, limit=None)
        return seg if seg is not None else self.take_chunk() if size <= self.chunk_bytes else None

    def take(self, size: int) -> Segment | None:
        """A pre-faulted segment of exactly ``size`` bytes, or None on a miss."""
        if self.budget <= 0:
            return None
        seg = self._take_recycled(size)
        if seg is None and size < self.MIN_CLASS // 2:
            return None
        if seg is None and size <= self.chunk_bytes:
            seg = self.take_chunk()
        elif seg is None:
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

    def _take_recycled(self, size: int, limit: int | None = 2) -> Segment | None:
        """The smallest recycled segment of at least ``size`` bytes (and at most ``limit * size``)."""
        with self._lock:
            at = bisect.bisect_left(self._recycled, size, key=_size)
            if at == len(self._recycled) or (limit is not None and self._recycled[at].size > limit * size):
                return None
            seg = self._recycled.pop(at)
            self._bytes -= seg.size
            return seg

    def recycle(self, seg: Segment) -> bool:
        """Keep a segment whose bytes were freed, faulted pages and all, for the next allocation. Only for
        memory no caller was given (``exported`` false) and no reader holds; False when the budget is full
        (the caller then unlinks it)."""
        if seg.exported or seg.readers or not seg.size:
            return False
        with self._lock:
            if self._closed or self._bytes + seg.size > self.budget:
                return False
            seg.blobs = 1
            if seg.size == self.chunk_bytes:
                self._chunks.append(seg)
            else:
                bisect.insort(self._recycled, seg, key=_size)
            self._bytes += seg.size
            return True

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
                    dropped.append(self._chunks.pop(0))  # the least recently recycled first
                    self._bytes -= dropped[-1].size
                if self._bytes + cls <= self.budget:
                    return cls, self._stock.setdefault(cls, []), dropped
                self._chunks[:0] = dropped
                self._bytes += sum(s.size for s in dropped)
            if self._bytes + self.chunk_bytes <= self.budget:
                return self.chunk_bytes, self._chunks, []
            return None

    def refill(self, busy: Callable[[], bool] = lambda: False) -> int:
        """Pre-fault segments until the budget is used or ``busy()`` (blocking; ``busy`` is asked between
        steps of a few MiB, so the hot path never waits long, and so is whether the stock was closed meanwhile);
        returns bytes added. A segment cut short by ``busy`` is kept with the pages it has."""
        added = 0

        def stop() -> bool:  # a closing stock stops at once too: its worker is stopping, or being killed
            return self._closed or busy()

        while not stop() and (job := self._next_build()) is not None:
            size, into, dropped = job
            for seg in dropped:
                seg.unlink()
                seg.try_close()
            try:
                seg = Segment.create(self.directory, self.prefix, size)
            except Exception as exc:  # a full /dev/shm: the stock is an optimisation, never an error
                log.debug("prefault of %d bytes failed: %s", size, exc)
                return added
            complete = seg.prefault(stop)
            with self._lock:
                if not self._closed:
                    # Behind the recycled ones (``recycle`` appends, takes pop): same-host writers keep those
                    # mapped and faulted in (``client.write_maps``), so a put fills them at memory speed.
                    into.insert(0, seg)
                    self._bytes += size
                    added += size
                    if complete:
                        continue
                    return added
            seg.unlink()
            seg.try_close()
            return added
        return added

    def close(self) -> None:
        with self._lock:
            self._closed = True
            segs = self._chunks + self._recycled + [s for ss in self._stock.values() for s in ss]
            self._chunks, self._recycled = [], []
            self._stock.clear()
            self._bytes = 0
        for s in segs:
            s.unlink()
            s.try_close()
