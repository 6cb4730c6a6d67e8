"""A worker's memory tier: ``PoolState`` decisions applied to shared-memory segments and slab arenas.

Owns: where each blob's bytes are (its own segment for a large tensor, a slot in a slab arena for small
objects such as KV pages, or a place in a pack segment shared by the tensors of one batch, e.g. a
checkpoint), allocating under the capacity (pre-faulted stock first), committing uploads
(deduplicated by digest), which blobs' bytes are still unchecked against their digest (written by a
same-host caller that stated it) and condemning one that failed the check, replicas as sets of blobs,
eviction, and read leases that keep bytes from being unmapped or reused while a data-plane thread sends
them. Thread-safe: data-plane threads take leases while the event loop mutates. Does not own: placement
policy (``worker``), checking digests (``worker.trust``), the disk tier (``pool.disk``), which chunk a pack's
blobs go into (``pool.packs``), the pre-faulted stock (``pool.stock``).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from tensorcast import clock
from tensorcast.errors import NotFound
from tensorcast.pool.packs import Chunks, PackChunks
from tensorcast.pool.segments import SHM_DIR, Segment, remove_stale_segments
from tensorcast.pool.slab import SlabAllocator
from tensorcast.pool.state import MemoryReplica, PoolState
from tensorcast.pool.stock import SegmentStock
from tensorcast.records import TensorMeta

__all__ = ["BlobLoc", "MemoryTier"]


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
        self.packs = PackChunks(self.lock, self.stock, prefix, self._retire)
        self.last_alloc = 0.0  # monotonic time of the last allocation: the stock refills after a quiet spell
        remove_stale_segments(prefix)

    # ----------------------------------------------------------------- uploads
    def allocate(self, nbytes: int) -> BlobLoc:
        """Room for one blob (the caller made room first if needed); raises ``ResourceExhausted``."""
        self.last_alloc = clock.monotonic()
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
        nothing. (The chunks are ``pool.packs``'.)
        """
        self.last_alloc = clock.monotonic()
        out: list[BlobLoc | None] = [None] * len(sizes)
        opened = self.packs.take_open()
        chunks: Chunks = [] if opened is None else [(opened[0], [opened[1]])]

        def put(i: int, seg: Segment, offset: int) -> None:
            with self.lock:
                self.state.reserve(sizes[i])
            out[i] = BlobLoc(seg, offset, sizes[i], sizes[i])

        try:
            for k in range(len(sizes)):
                if not 0 < sizes[k] <= self.stock.chunk_bytes:
                    out[k] = self.allocate(sizes[k])  # a tensor larger than a chunk: a segment of its own
            self.packs.place(sizes, chunks, put)
        except BaseException:
            for loc in out:
                if loc is not None:
                    self.discard(loc)
            with self.lock:
                self.packs.give_up(chunks, opened)
            raise
        self.packs.keep_open(chunks, opened is not None)
        return [loc for loc in out if loc is not None]

    def prefaulted_room(self) -> int:
        """Bytes a pack can take without creating a segment (the open chunk's room and the stock's), roughly:
        a pack that fits is carved at memory speed and may be allocated inline."""
        return self.packs.open_room() + self.stock.ready_bytes

    def trim(self) -> int:
        """Give back the unused tail pages of the chunks that packs were carved from; returns the bytes
        given back. Blocking (call it off the event loop, when the hot path is done)."""
        return self.packs.trim()

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
        if self.packs.recyclable(segment) and self.stock.recycle(segment):
            self.packs.recycled(segment)  # it is whole
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
            opened = self.packs.take_open()
            if opened is not None and all(s is not opened[0] for s in segs):
                segs.append(opened[0])
            for seg in segs + list(self._arenas.values()) + self._closing:
                seg.unlink()
                seg.try_close()
            self._blobs.clear()
            self._unverified.clear()
            self._arenas.clear()
            self._closing.clear()
        self.stock.close()
        remove_stale_segments(self.prefix)
