"""A worker's memory tier: ``PoolState`` decisions applied to shared-memory segments and slab arenas.

Owns: where each blob's bytes are (its own segment for a large tensor, a slot in a slab arena for small
objects such as KV pages, or a place in a pack segment shared by the tensors of one batch, e.g. a
checkpoint), allocating under the capacity (pre-faulted stock first), committing uploads
(deduplicated by digest), replicas as sets of blobs, eviction, and read leases that keep bytes from being
unmapped or reused while a data-plane thread sends them. Thread-safe: data-plane threads take leases
while the event loop mutates. Does not own: placement policy (``worker``), the disk tier (``pool.disk``).
"""

from __future__ import annotations

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
from tensorcast.wire.messages import TensorMeta

__all__ = ["BlobLoc", "MemoryTier"]

_PAGE = mmap.PAGESIZE  # blobs in a pack start on a page: callers map each one on its own


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
        self._closing: list[Segment] = []
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
        """Room for a batch of blobs that live and die together (the tensors of one artifact or view).

        They are carved, page-aligned, out of pre-faulted stock chunks (in order), so that a checkpoint of
        hundreds of tensors is filled without first-touch faults; small ones too, so that callers can map
        them (arena slots are reused, so they are never mapped). A tensor larger than a chunk, or any once
        the stock is empty, is allocated alone (an arena slot, or a segment of its own). A chunk goes when
        its last blob does: until then freed blobs' pages stay (they may be mapped by callers). Blocking
        (it may create segments): call it off the event loop. All or nothing.
        """
        self.last_alloc = time.monotonic()
        out: list[BlobLoc | None] = [None] * len(sizes)
        open_chunk: Segment | None = None
        used = 0
        try:
            for i, size in enumerate(sizes):
                if not size or size > self.stock.chunk_bytes:
                    out[i] = self.allocate(size)
                    continue
                if open_chunk is not None and used + size > open_chunk.size:
                    self._close_chunk(open_chunk, used)
                    open_chunk = None
                if open_chunk is None:
                    open_chunk, used = self.stock.take_chunk(), 0
                    if open_chunk is None:  # the stock is empty: an arena slot, or a segment of its own
                        out[i] = self.allocate(size)
                        continue
                    open_chunk.blobs = 0
                with self.lock:
                    self.state.reserve(size)
                open_chunk.blobs += 1
                out[i] = BlobLoc(open_chunk, used, size, size)
                used += -(-size // _PAGE) * _PAGE
            if open_chunk is not None:
                self._close_chunk(open_chunk, used)
        except BaseException:
            if open_chunk is not None and open_chunk.blobs == 0:
                self._retire(open_chunk)  # taken from the stock, nothing placed in it yet
            for loc in out:
                if loc is not None:
                    self.discard(loc)
            raise
        return [loc for loc in out if loc is not None]

    def _close_chunk(self, chunk: Segment, used: int) -> None:
        if chunk.blobs == 0:
            self._retire(chunk)
        else:
            chunk.shrink(min(chunk.size, used))  # give back the tail pages

    def discard(self, loc: BlobLoc) -> None:
        """Give back an allocation that was never committed."""
        with self.lock:
            self.state.unreserve(loc.accounted)
            self._release_loc(loc)

    def commit_blob(self, digest: str, loc: BlobLoc) -> None:
        with self.lock:
            if self.state.commit_blob(digest, loc.accounted):
                self._blobs[digest] = loc
            else:
                self._release_loc(loc)  # someone stored the same bytes first

    def has_blob(self, digest: str) -> bool:
        with self.lock:
            return self.state.has_blob(digest)

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
            for seg in segs + list(self._arenas.values()) + self._closing:
                seg.unlink()
                seg.try_close()
            self._blobs.clear()
            self._arenas.clear()
            self._closing.clear()
        self.stock.close()
        remove_stale_segments(self.prefix)
