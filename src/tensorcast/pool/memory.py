"""A worker's memory tier: ``PoolState`` decisions applied to shared-memory segments and slab arenas.

Owns: where each blob's bytes are (its own segment for a large tensor, a slot in a slab arena for small
objects such as KV pages, or a place in a pack segment shared by the tensors of one batch, e.g. a
checkpoint), allocating under the capacity (pre-faulted stock first), committing uploads
(deduplicated by digest), which blobs' bytes are still unchecked against their digest (written by a
same-host caller that stated it) and condemning one that failed the check, replicas as sets of blobs,
eviction, and read leases that keep bytes from being unmapped or reused while a data-plane thread sends
them. Thread-safe: data-plane threads take leases while the event loop mutates. Does not own: placement
policy (``worker``), checking digests (``worker.trust``), the disk tier (``pool.disk``).
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from tensorcast.errors import NotFound
from tensorcast.pool.segments import SHM_DIR, Segment, SegmentStock, remove_stale_segments
from tensorcast.pool.slab import SlabAllocator
from tensorcast.pool.state import MemoryReplica, PoolState
from tensorcast.records import TensorMeta

__all__ = ["BlobLoc", "MemoryTier"]

_PAGE = mmap.PAGESIZE  # blobs in a pack start on a page: callers map each one on its own
# A chunk stays open for the next batch only with at least this much room left.
_MIN_OPEN_ROOM = 1024 * 1024


def _pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages: the room a blob takes in a pack."""
    return -(-nbytes // _PAGE) * _PAGE


@dataclass(frozen=True, slots=True)
class BlobLoc:
    segment: Segment
    offset: int
    size: int  # bytes of the object
    accounted: int  # bytes charged to the capacity (the slot size for arena objects)
    arena: str | None = None

    def view(self) -> memoryview:
        return self.segment.view()[self.offset : self.offset + self.size]


class MemoryTier:
    def __init__(self, capacity: int, prefix: str, *, stock_budget: int = 0, stock_chunk_bytes: int = 256 << 20,
                 arena_bytes: int = 16 << 20, small_object_bytes: int = 256 << 10) -> None:
        self.state = PoolState(capacity)
        self.prefix = prefix
        self.slab = SlabAllocator(arena_bytes, max_slot=small_object_bytes)
        self.stock = SegmentStock(SHM_DIR, f"{prefix}-s", stock_budget, stock_chunk_bytes)
        self.lock = threading.RLock()
        self._blobs: dict[str, BlobLoc] = {}
        self._arenas: dict[str, Segment] = {}
        self._tensors: dict[str, tuple[TensorMeta, ...]] = {}
        # Committed blobs whose bytes nobody here has checked against their digest (a same-host caller wrote
        # them and stated it): never deduplicated onto or handed out before they are (``worker.trust``).
        self._unverified: set[str] = set()
        self._closing: list[Segment] = []
        self._untrimmed: list[tuple[Segment, int]] = []  # pack chunks and the bytes they use
        self._open: tuple[Segment, int] | None = None  # the chunk the next pack continues in, and its bytes used
        self._trimming: set[int] = set()  # ids of chunks being cut down right now
        self.last_alloc = 0.0  # monotonic time of the last allocation: the stock refills after a quiet spell
        remove_stale_segments(prefix)

    # ----------------------------------------------------------------- uploads
    def allocate(self, nbytes: int) -> BlobLoc:
        """Room for one blob (the caller made room first if needed); raises ``ResourceExhausted``."""
        self.last_alloc = time.monotonic()
        with self.lock:
            slot = self.slab.slot_size(nbytes)
            if slot is not None:
                self.state.reserve(slot)
                try:
                    got = self.slab.alloc(nbytes)
                    if isinstance(got, int):
                        arena_id = uuid.uuid4().hex[:12]
                        seg = Segment.create(SHM_DIR, f"{self.prefix}-a", self.slab.arena_bytes, populate=True)
                        self._arenas[arena_id] = seg
                        self.slab.add_arena(arena_id, got)
                        got = self.slab.alloc(nbytes)
                        assert not isinstance(got, int)
                except BaseException:
                    self.state.unreserve(slot)
                    raise
                arena_id, offset = got
                return BlobLoc(self._arenas[arena_id], offset, nbytes, slot, arena_id)
            self.state.reserve(nbytes)
        try:
            seg = self.stock.take(nbytes) or Segment.create(SHM_DIR, self.prefix, nbytes)
        except BaseException:
            with self.lock:
                self.state.unreserve(nbytes)
            raise
        return BlobLoc(seg, 0, nbytes, nbytes)

    def allocate_pack(self, sizes: list[int]) -> list[BlobLoc]:
        """Room for a batch of blobs (the tensors of one artifact or view, a checkpoint's hundreds of tensors).

        They are carved, page-aligned, out of pre-faulted stock chunks, so that they are filled without
        first-touch faults; small ones too, so that callers can map them (arena slots are reused, so they
        are never mapped). Largest first, each into the chunk with the least room that still fits it (best
        fit decreasing): the batch takes as few chunks as it can. The chunk with the most room left stays
        *open*: the next batch continues in it, so a stream of small transfers keeps filling one chunk
        instead of taking (and later trimming) a chunk each. Freed blobs' pages in a chunk are never handed
        out again while the chunk lives (callers may have them mapped); a chunk goes with its last blob,
        back to the stock if no caller was ever given it. Once the stock is empty, fresh segments (not
        pre-faulted) take its place. A tensor larger than a chunk gets a segment of its own. Other chunks'
        unused tails are given back later, by ``trim()``. Blocking: call it off the event loop. All or
        nothing.
        """
        self.last_alloc = time.monotonic()
        out: list[BlobLoc | None] = [None] * len(sizes)
        chunks: list[tuple[Segment, list[int]]] = []  # (chunk, [bytes used]); the open one first, if any
        with self.lock:  # the open chunk is this batch's alone until it is handed back
            opened, self._open = self._open, None
        if opened is not None:
            chunks.append((opened[0], [opened[1]]))
        try:
            for k in range(len(sizes)):
                if not 0 < sizes[k] <= self.stock.chunk_bytes:
                    out[k] = self.allocate(sizes[k])  # a tensor larger than a chunk: a segment of its own
            self._place(sizes, out, chunks)
        except BaseException:
            for loc in out:
                if loc is not None:
                    self.discard(loc)
            with self.lock:
                for k, (seg, _) in enumerate(chunks):
                    if k == 0 and opened is not None:
                        self._hand_back_open(seg, opened[1])  # nothing of this batch stays in it
                    elif seg.blobs == 0:
                        self._retire(seg)  # taken from the stock, nothing placed in it yet
            raise
        self._keep_open(chunks, opened is not None)
        return [loc for loc in out if loc is not None]

    def _place(self, sizes: list[int], out: list[BlobLoc | None], chunks: list[tuple[Segment, list[int]]]) -> None:
        """Best fit decreasing of the blobs that fit a chunk into ``chunks``, taking more as needed."""
        chunk_bytes = self.stock.chunk_bytes
        order = sorted((k for k in range(len(sizes)) if 0 < sizes[k] <= chunk_bytes), key=lambda k: -sizes[k])
        left = sum(_pages(sizes[k]) for k in order)  # bytes still to place
        room = sorted((seg.size - used[0], k) for k, (seg, used) in enumerate(chunks))  # best fit by bisection
        for i in order:
            size = sizes[i]
            at = bisect.bisect_left(room, (_pages(size), -1))
            if at < len(room):
                k = room.pop(at)[1]
            else:
                # Recycled or pre-faulted memory from the stock; once it is empty, a fresh segment for the
                # rest (faulted in as it is filled): small tensors stay in a pack, where callers can map
                # them, not in arena slots.
                seg = self.stock.take_for_pack(_pages(size)) or \
                    Segment.create(SHM_DIR, self.prefix, min(chunk_bytes, left))
                seg.blobs = 0
                k = len(chunks)
                chunks.append((seg, [0]))
            seg, used = chunks[k]
            with self.lock:
                self.state.reserve(size)
            seg.blobs += 1
            out[i] = BlobLoc(seg, used[0], size, size)
            used[0] += _pages(size)
            left -= _pages(size)
            if used[0] < seg.size:
                bisect.insort(room, (seg.size - used[0], k))

    def _keep_open(self, chunks: list[tuple[Segment, list[int]]], had_open: bool) -> None:
        """After a batch: the chunk with the most room left stays open for the next one; the others' tails
        wait for ``trim()``. An open chunk holds one reference of its own, so it outlives its blobs."""
        with self.lock:
            best = max(range(len(chunks)), key=lambda k: chunks[k][0].size - chunks[k][1][0], default=-1)
            for k, (seg, used) in enumerate(chunks):
                was_open = had_open and k == 0
                if k == best and seg.size - used[0] >= _MIN_OPEN_ROOM:
                    if not was_open:
                        seg.blobs += 1
                    self._hand_back_open(seg, used[0])
                elif was_open:
                    self._close_open(seg, used[0])
                elif used[0] < seg.size:
                    self._untrimmed.append((seg, used[0]))

    def _hand_back_open(self, seg: Segment, used: int) -> None:
        """Make ``seg`` the open chunk (with the lock held); if another batch set one meanwhile, the one with
        less room left is closed."""
        if self._open is not None:
            other, other_used = self._open
            if other.size - other_used >= seg.size - used:
                self._close_open(seg, used)
                return
            self._close_open(other, other_used)
        self._open = (seg, used)

    def _close_open(self, seg: Segment, used: int) -> None:
        """A chunk stops being open: without blobs it goes (back to the stock, whole), else its tail waits
        for ``trim()``."""
        seg.blobs -= 1
        if seg.blobs <= 0:
            self._retire(seg)
        elif used < seg.size:
            self._untrimmed.append((seg, used))

    def prefaulted_room(self) -> int:
        """Bytes a pack can take without creating a segment (the open chunk's room and the stock's), roughly:
        a pack that fits is carved at memory speed and may be allocated inline."""
        with self.lock:
            room = self._open[0].size - self._open[1] if self._open is not None else 0
        return room + self.stock.ready_bytes

    def trim(self) -> int:
        """Give back the unused tail pages of the chunks that packs were carved from; returns the bytes
        given back. Blocking (call it off the event loop, when the hot path is done)."""
        with self.lock:
            todo, self._untrimmed = self._untrimmed, []
            self._trimming.update(id(seg) for seg, _ in todo)  # not recycled while being cut
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
                    self._trimming.discard(id(seg))
        return freed

    def discard(self, loc: BlobLoc) -> None:
        """Give back an allocation that was never committed."""
        with self.lock:
            self.state.unreserve(loc.accounted)
            self._release_loc(loc)

    def commit_blob(self, digest: str, loc: BlobLoc, verified: bool = True) -> None:
        """Store an upload as blob ``digest``; ``verified=False``: its bytes were not checked against the digest
        here. A blob held already stays (the caller checked it first: ``worker.trust``) and ``loc`` is freed."""
        with self.lock:
            if self.state.commit_blob(digest, loc.accounted):
                self._blobs[digest] = loc
                if not verified:
                    self._unverified.add(digest)
            else:
                self._release_loc(loc)  # someone stored the same bytes first

    def has_blob(self, digest: str) -> bool:
        with self.lock:
            return self.state.has_blob(digest)

    def held(self, digest: str) -> BlobLoc | None:
        """Where blob ``digest`` is (None: not held); the same object until the blob is freed."""
        return self._blobs.get(digest)

    # ----------------------------------------------------------------- trust
    def is_unverified(self, digest: str) -> bool:
        """The blob is held and its bytes were never checked against its digest here."""
        return digest in self._unverified

    @property
    def any_unverified(self) -> bool:
        return bool(self._unverified)

    def is_verified(self, digest: str) -> bool:
        with self.lock:
            return digest in self._blobs and digest not in self._unverified

    def mark_verified(self, digest: str) -> None:
        with self.lock:
            self._unverified.discard(digest)

    def unverified_blobs(self) -> list[tuple[str, int]]:
        """(digest, size) of the blobs not checked yet."""
        with self.lock:
            return [(d, self._blobs[d].size) for d in self._unverified if d in self._blobs]

    def condemn(self, digest: str) -> list[str]:
        """Drop a blob whose bytes do not match its digest, and every replica using it (returned): as an
        eviction of those replicas, except that the blob's pages never go back to the stock for other bytes
        (callers' existing mappings keep the old pages). A later upload of ``digest`` is stored afresh."""
        with self.lock:
            loc = self._blobs.get(digest)
            if loc is None:
                return []
            if loc.arena is None:
                loc.segment.exported = True  # retired with its last blob: unlinked, never recycled
            users = self.state.replicas_using(digest)
            for aid in users:
                self.remove_replica(aid)
            self._free_blob(digest)  # unreferenced (an upload committed, its replica not recorded yet)
            return users

    # ----------------------------------------------------------------- replicas
    def add_replica(self, rep: MemoryReplica, tensors: tuple[TensorMeta, ...]) -> None:
        with self.lock:
            if self.state.add_replica(rep):
                self._tensors[rep.artifact_id] = tensors

    def has_replica(self, artifact_id: str) -> bool:
        return artifact_id in self._tensors

    def tensors(self, artifact_id: str) -> tuple[TensorMeta, ...]:
        try:
            return self._tensors[artifact_id]
        except KeyError:
            raise NotFound(f"artifact {artifact_id} has no memory replica on this worker") from None

    def remove_replica(self, artifact_id: str) -> bool:
        with self.lock:
            if self._tensors.pop(artifact_id, None) is None:
                return False
            for digest in self.state.remove_replica(artifact_id):
                self._free_blob(digest)
            return True

    def release_unreferenced(self) -> None:
        with self.lock:
            for digest in self.state.unreferenced():
                self._free_blob(digest)

    def replica_ids(self) -> list[str]:
        return list(self._tensors)

    def blob(self, digest: str) -> BlobLoc:
        try:
            return self._blobs[digest]
        except KeyError:
            raise NotFound(f"blob {digest[:16]} is not in memory here") from None

    def lease(self, digest: str) -> tuple[BlobLoc, Callable[[], None]]:
        """Read lease: the blob's bytes stay mapped and unreused until the returned callable runs."""
        with self.lock:
            loc = self.blob(digest)
            if loc.arena is not None:
                self.slab.lease(loc.arena, loc.offset)
            else:
                loc.segment.readers += 1

        def release() -> None:
            with self.lock:
                if loc.arena is not None:
                    empty = self.slab.release_lease(loc.arena, loc.offset)
                    if empty is not None:
                        self._retire(self._arenas.pop(empty))
                else:
                    loc.segment.readers -= 1

        return loc, release

    # ----------------------------------------------------------------- internals
    def _free_blob(self, digest: str) -> None:
        if self.state.free_blob(digest):
            self._unverified.discard(digest)
            self._release_loc(self._blobs.pop(digest))

    def _release_loc(self, loc: BlobLoc) -> None:
        if loc.arena is not None:
            empty = self.slab.free(loc.arena, loc.offset)
            if empty is not None:
                self._retire(self._arenas.pop(empty))
        else:
            loc.segment.blobs -= 1
            if loc.segment.blobs <= 0:
                self._retire(loc.segment)

    def _retire(self, segment: Segment) -> None:
        """A segment's last blob is gone (the lock is held): its memory goes back to the stock when no caller
        was ever given it and no reader holds it (its pages stay faulted), else it is unlinked and unmapped."""
        if id(segment) not in self._trimming and self.stock.recycle(segment):
            self._untrimmed = [(s, used) for s, used in self._untrimmed if s is not segment]  # it is whole
            return
        segment.unlink()
        if not segment.try_close():
            self._closing.append(segment)

    def collect(self) -> None:
        """Unmap retired segments whose readers have finished."""
        with self.lock:
            self._closing = [s for s in self._closing if not s.try_close()]

    def close(self) -> None:
        with self.lock:
            segs = list({id(b.segment): b.segment for b in self._blobs.values() if b.arena is None}.values())
            if self._open is not None and all(s is not self._open[0] for s in segs):
                segs.append(self._open[0])
            self._open = None
            for seg in segs + list(self._arenas.values()) + self._closing:
                seg.unlink()
                seg.try_close()
            self._blobs.clear()
            self._unverified.clear()
            self._arenas.clear()
            self._closing.clear()
        self.stock.close()
        remove_stale_segments(self.prefix)
