"""A worker's local replicas across both tiers, with placement applied: the basic role's core.

Owns: which artifacts this worker holds in memory and on disk, making room (LRU eviction of evictable,
unpinned memory replicas, with the global store told), pins, the cold placement's memory TTL, watermark
eviction, dropping replicas, and the byte sources the data plane and same-host mappings read from
(memory first, then disk; slices cut here, so only the slice's bytes leave). Thread-safe where the data
plane needs it. Does not own: the put and fetch protocols (``worker.puts``, ``worker.fetch``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import numpy as np

from tensorcast import clock
from tensorcast.checksums import CHUNK_BYTES, chunk_count
from tensorcast.config import WorkerConfig
from tensorcast.errors import InvalidArgument, NotFound, clip
from tensorcast.pool.disk import DiskTier, Manifest
from tensorcast.pool.memory import BlobLoc, MemoryTier
from tensorcast.pool.placement import Placement
from tensorcast.pool.segments import Segment
from tensorcast.pool.state import MemoryReplica
from tensorcast.records import SegmentRef, TensorMeta, WorkerLoad
from tensorcast.tensors import raw_dtype
from tensorcast.transport.base import SourceLease
from tensorcast.views import apply_slices
from tensorcast.weights.object_store import is_object_url
from tensorcast.weights.safetensors import CheckpointTensor
from tensorcast.wire.messages import DataRequest
from tensorcast.worker.in_place import in_place_source, read_in_place

__all__ = ["LocalStore"]

log = logging.getLogger("tensorcast.worker")

# Called when a replica disappears from this worker without the GS having asked (eviction, TTL).
ReplicaGone = Callable[[str, str], Awaitable[None]]
# Blobs whose chunk checksums senders are still collecting (ranges sent so far do not cover them yet), and
# blobs whose checksums are cached (a few hundred bytes each; the blobs themselves come and go).
_MAX_LEARNING = 4096
_MAX_CHECKSUMS = 65536


class LocalStore:
    def __init__(self, config: WorkerConfig, worker_id: str, on_replica_gone: ReplicaGone) -> None:
        self.config = config
        self.evicted_bytes = 0  # memory freed by evictions since start (a metric)
        self.memory = MemoryTier(config.memory_capacity, f"{config.shm_prefix}-{worker_id}",
                                 stock_budget=config.prefault_bytes,
                                 stock_chunk_bytes=config.prefault_chunk_bytes, arena_bytes=config.arena_bytes,
                                 small_object_bytes=config.small_object_bytes)
        self.disk = DiskTier(Path(config.disk_dir), config.disk_capacity) if config.disk_dir else None
        self._on_replica_gone = on_replica_gone
        self._lock = threading.Lock()
        self._disk_segments: dict[str, Segment] = {}  # open read mappings of disk blobs
        # digest -> data-plane chunk checksums, the most recently added last (bounded: blobs come and go).
        self._checksums: OrderedDict[str, list[int]] = OrderedDict()
        self._learning: dict[str, dict[int, int]] = {}  # digest -> chunk checksums senders computed so far
        # Checkpoints registered in place (from_disk): artifact id -> tensor name -> where its bytes are.
        self.external: dict[str, dict[str, CheckpointTensor]] = {}
        self._external_meta: dict[str, tuple[TensorMeta, ...]] = {}
        self._external_verify: dict[str, bool] = {}
        self._stale: list[Segment] = []  # mappings of disk blob files replaced meanwhile, closed once unread
        if self.disk is not None:
            self.disk.replaced = self._disk_blob_replaced

    # ----------------------------------------------------------------- queries
    def tiers(self, artifact_id: str) -> tuple[str, ...]:
        out = []
        if self.memory.has_replica(artifact_id):
            out.append("memory")
        if (self.disk is not None and self.disk.has_artifact(artifact_id)) or artifact_id in self.external:
            out.append("disk")
        return tuple(out)

    def tensors(self, artifact_id: str) -> tuple[TensorMeta, ...]:
        if self.memory.has_replica(artifact_id):
            return self.memory.tensors(artifact_id)
        if self.disk is not None and artifact_id in self.disk.manifests:
            return self.disk.manifests[artifact_id].tensors
        if artifact_id in self._external_meta:
            return self._external_meta[artifact_id]
        raise NotFound(f"artifact {artifact_id} has no replica on this worker")

    def meta(self, artifact_id: str, name: str) -> TensorMeta:
        for t in self.tensors(artifact_id):
            if t.name == name:
                return t
        raise NotFound(f"artifact {artifact_id} has no tensor {clip(name)}")

    def require_disk(self) -> DiskTier:
        if self.disk is None:
            raise InvalidArgument("this worker has no disk tier (worker.disk_dir is not set)")
        return self.disk

    def stats(self) -> WorkerLoad:
        """The tiers' part of the worker's load (the network and plan figures are the roles')."""
        return WorkerLoad(
            memory_used=self.memory.state.used, memory_capacity=self.memory.state.capacity,
            artifacts=len(set(self.memory.replica_ids()) | set(self.disk.manifests if self.disk else ())),
            disk_used=self.disk.used if self.disk else 0, disk_capacity=self.disk.capacity if self.disk else 0,
            memory_prefaulted=self.memory.stock.ready_bytes)

    # ----------------------------------------------------------------- room and memory replicas
    async def make_room(self, nbytes: int, exclude: frozenset[str] = frozenset()) -> None:
        """Ensure ``nbytes`` fit in memory, evicting least recently used replicas as needed; raises
        ``ResourceExhausted`` (nothing evicted) when evicting everything evictable would not be enough."""
        await self.evict_all(self.memory.state.victims(nbytes, clock.time(), exclude))

    async def evict_all(self, artifact_ids: Iterable[str]) -> None:
        for aid in artifact_ids:
            await self.evict(aid)

    async def report_gone(self, artifact_id: str, tier: str) -> None:
        """Tell the global store a replica left this worker without its asking (an eviction, a bad blob)."""
        await self._on_replica_gone(artifact_id, tier)

    async def evict(self, artifact_id: str) -> None:
        used = self.memory.state.used
        if self.memory.remove_replica(artifact_id):
            self.evicted_bytes += used - self.memory.state.used  # what the eviction really freed
            log.info("evicted memory replica of %s", artifact_id)
            await self._on_replica_gone(artifact_id, "memory")

    def add_memory_replica(self, artifact_id: str, tensors: tuple[TensorMeta, ...], placement: Placement,
                           pin_until: float | None = None) -> None:
        now = clock.time()
        self.memory.add_replica(MemoryReplica(
            artifact_id=artifact_id,
            digests=tuple(t.digest for t in tensors if t.nbytes),
            evictable=placement.evictable,
            pinned_until=pin_until,
            last_access=now,
            memory_expires=None if placement.memory_ttl is None else now + placement.memory_ttl,
        ), tensors)

    def pin(self, artifact_id: str, ttl: float | None) -> None:
        self.memory.state.pin(artifact_id, None if ttl is None else clock.time() + ttl)

    def unpin(self, artifact_id: str) -> None:
        self.memory.state.unpin(artifact_id)

    def touch(self, artifact_id: str) -> None:
        self.memory.state.touch(artifact_id, clock.time())

    async def housekeeping(self) -> None:
        """Cold TTLs and watermarks: evict what placement says must go."""
        now = clock.time()
        for aid in self.memory.state.expired(now):
            await self.evict(aid)
        for aid in self.memory.state.watermark_victims(self.config.memory_high_watermark,
                                                       self.config.memory_low_watermark, now):
            await self.evict(aid)
        self.memory.collect()
        with self._lock:
            self._stale = [seg for seg in self._stale if not seg.try_close()]

    def drop(self, artifact_id: str) -> bool:
        """Forget every local replica of an artifact (it was deleted)."""
        gone = self.memory.remove_replica(artifact_id)
        if self.external.pop(artifact_id, None) is not None:
            self._external_meta.pop(artifact_id, None)
            if self.config.disk_dir:
                with contextlib.suppress(OSError):
                    (Path(self.config.disk_dir) / "external" / artifact_id).unlink()
            gone = True
        if self.disk is not None and self.disk.remove_artifact(artifact_id):
            gone = True
            self.close_disk_segments()
        return gone

    def close_disk_segments(self) -> None:
        """Close the read mappings of disk blob files no longer held."""
        assert self.disk is not None
        with self._lock:
            for d in [d for d in self._disk_segments if not self.disk.has_blob(d)]:
                seg = self._disk_segments.pop(d)
                seg.unlink()
                seg.try_close()

    def _disk_blob_replaced(self, digest: str) -> None:
        """(On a storing thread.) A disk blob file was replaced: its old mapping and checksums are stale."""
        with self._lock:
            seg = self._disk_segments.pop(digest, None)
            if seg is not None and not seg.try_close():
                self._stale.append(seg)
        self.forget_checksums(digest)

    # ----------------------------------------------------------------- disk replicas
    def copy_to_disk(self, artifact_id: str, tensors: tuple[TensorMeta, ...], policy: str) -> None:
        """Write a memory replica's blobs to the disk tier (durable once this returns). Blocking."""
        disk = self.require_disk()
        for t in tensors:
            if t.nbytes and not disk.has_blob(t.digest):
                loc, release = self.memory.lease(t.digest)
                try:
                    disk.write_blob(t.digest, loc.view(), verified=self.memory.is_verified(t.digest))
                finally:
                    release()
        disk.add_artifact(Manifest(artifact_id, tensors, policy))

    # ----------------------------------------------------------------- checkpoints in place
    def add_external(self, artifact_id: str, tensors: tuple[TensorMeta, ...],
                     locations: dict[str, CheckpointTensor], verify: bool, source: str) -> None:
        self.external[artifact_id] = locations
        self._external_meta[artifact_id] = tensors
        self._external_verify[artifact_id] = verify
        if self.config.disk_dir:  # remembered across restarts (the files are re-validated then)
            reg = Path(self.config.disk_dir) / "external"
            reg.mkdir(parents=True, exist_ok=True)
            (reg / artifact_id).write_text(json.dumps({"path": source, "verify": verify}))

    def external_registrations(self) -> list[tuple[str, str, bool]]:
        """(artifact id, path, verify) of checkpoints registered in place before a restart."""
        reg = Path(self.config.disk_dir) / "external" if self.config.disk_dir else None
        if reg is None or not reg.exists():
            return []
        out = []
        for f in reg.iterdir():
            with contextlib.suppress(OSError, ValueError, KeyError):
                doc = json.loads(f.read_text())
                out.append((f.name, str(doc["path"]), bool(doc["verify"])))
        return out

    def external_location(self, artifact_id: str, name: str) -> CheckpointTensor | None:
        return self.external_locations(artifact_id, [name]).get(name)

    def external_locations(self, artifact_id: str, names: Iterable[str]) -> dict[str, CheckpointTensor]:
        """Where these tensors of a checkpoint registered in place lie (those that are not: absent). Each
        file is checked once (still there, same size and mtime as when it was registered)."""
        registered = self.external.get(artifact_id, {})
        found = {n: loc for n in names if (loc := registered.get(n)) is not None}
        if self._external_verify.get(artifact_id, True):
            checked: set[str] = set()
            for name, loc in found.items():
                if loc.file in checked or is_object_url(loc.file):  # an object: each GET is pinned to its ETag
                    continue
                checked.add(loc.file)
                try:
                    st = os.stat(loc.file)
                except OSError as exc:
                    raise NotFound(f"checkpoint file {loc.file} (tensor {clip(name)}) is gone: {exc}") from None
                if st.st_size != loc.file_size or st.st_mtime_ns != loc.file_mtime_ns:
                    raise InvalidArgument(f"checkpoint file {loc.file} changed since it was registered (tensor "
                                          f"{clip(name)}): register it again")
        return found

    # ----------------------------------------------------------------- sources
    def _disk_segment(self, digest: str) -> Segment:
        disk = self.require_disk()
        with self._lock:
            seg = self._disk_segments.get(digest)
            if seg is None:
                if not disk.has_blob(digest):
                    raise NotFound(f"blob {digest[:16]} is not on disk here")
                seg = Segment.open_existing(disk.blob_path(digest))
                self._disk_segments[digest] = seg
            seg.readers += 1
            return seg

    def lease_tensor(self, artifact_id: str, meta: TensorMeta, tier: str) -> tuple[memoryview, str, Callable[[], None]]:
        """A tensor's bytes from any local tier, checkpoints in place included, held until released."""
        loc = self._in_place(artifact_id, meta, tier)
        if loc is not None:
            return read_in_place(loc, meta, 0, loc.nbytes), "disk", lambda: None
        return self.lease_blob(meta, tier)

    def _in_place(self, artifact_id: str, meta: TensorMeta, tier: str) -> CheckpointTensor | None:
        """Where a tensor of a checkpoint registered in place lies, when that is where it is to be read from."""
        loc = self.external_location(artifact_id, meta.name) if tier in ("", "disk") else None
        return loc if loc is not None and not (tier == "" and self.memory.has_blob(meta.digest)) else None

    def lease_blob(self, meta: TensorMeta, tier: str) -> tuple[memoryview, str, Callable[[], None]]:
        if tier in ("", "memory") and self.memory.has_blob(meta.digest):
            loc, release = self.memory.lease(meta.digest)
            return loc.view(), "memory", release
        if tier in ("", "disk") and self.disk is not None and self.disk.has_blob(meta.digest):
            seg = self._disk_segment(meta.digest)

            def release_disk() -> None:
                with self._lock:
                    seg.readers -= 1

            return seg.view()[: meta.nbytes], "disk", release_disk
        raise NotFound(f"tensor {clip(meta.name)} ({meta.digest[:16]}) has no {tier or 'local'} replica here")

    def open_source(self, req: DataRequest) -> SourceLease:
        """Data plane: the bytes a request names, leased until sent. Called on data-plane threads."""
        meta = self.meta(req.artifact_id, req.name)
        if meta.nbytes == 0:
            return SourceLease(memoryview(b""), "memory", lambda: None)
        if (loc := self._in_place(req.artifact_id, meta, req.tier)) is not None:
            return in_place_source(loc, meta, req)
        view, tier, release = self.lease_tensor(req.artifact_id, meta, req.tier)
        if req.slices:
            try:
                arr = np.frombuffer(view, dtype=np.uint8).view(raw_dtype(meta.dtype)).reshape(meta.shape)
                piece = np.ascontiguousarray(apply_slices(arr, req.slices))
            except BaseException:
                release()
                raise
            if np.may_share_memory(piece, arr):  # contiguous rows are a view of the pool: leased until sent
                return SourceLease(piece.reshape(-1).view(np.uint8).data, tier, release)
            release()
            return SourceLease(piece.reshape(-1).view(np.uint8).data, tier, lambda: None)
        if req.offset % CHUNK_BYTES:
            return SourceLease(view, tier, release)
        checksums = self._checksums.get(meta.digest)
        if checksums is not None:
            return SourceLease(view, tier, release, checksums)
        # Not hashed yet (a fresh put's blob): the sender hashes each chunk as it sends it, which overlaps the
        # hashing with the transfer (a pass over the whole blob first would delay its first byte), and
        # hands the checksums back for the next send.
        learn = functools.partial(self._learn_checksums, meta.digest, chunk_count(len(view)))
        return SourceLease(view, tier, release, learn=learn)

    def _learn_checksums(self, digest: str, chunks: int, first: int, sums: list[int]) -> None:
        with self._lock:
            if len(self._learning) > _MAX_LEARNING:  # ranges never completed: start over, never unbounded
                self._learning.clear()
            known = self._learning.setdefault(digest, {})
            known.update(enumerate(sums, first))
            if len(known) >= chunks:
                del self._learning[digest]
                self._keep_checksums(digest, [known[i] for i in range(chunks)])

    def remember_checksums(self, digest: str, checksums: list[int]) -> None:
        """Chunk checksums a receiver verified: serving the blob later needs no hashing pass."""
        if checksums:
            with self._lock:
                self._keep_checksums(digest, checksums)

    def _keep_checksums(self, digest: str, checksums: list[int]) -> None:
        """(The lock held.) Cache a blob's checksums; the oldest go beyond ``_MAX_CHECKSUMS`` blobs (a blob
        sent again after that is hashed as it is sent, and learned again)."""
        self._checksums[digest] = checksums
        self._checksums.move_to_end(digest)
        while len(self._checksums) > _MAX_CHECKSUMS:
            self._checksums.popitem(last=False)

    def forget_checksums(self, digest: str) -> None:
        """Drop what is known of a blob's chunk checksums (its bytes were replaced)."""
        with self._lock:
            self._checksums.pop(digest, None)
            self._learning.pop(digest, None)

    def checksums_of(self, digest: str) -> list[int] | None:
        """The data-plane chunk checksums known for a blob (None: it will be hashed as it is sent)."""
        return self._checksums.get(digest)

    def segment_refs(self, artifact_id: str, names: tuple[str, ...], tier: str) -> list[SegmentRef | None]:
        """Same host: the files a caller may map for these tensors (None: read it instead)."""
        self.touch(artifact_id)
        refs: dict[str, SegmentRef | None] = {}
        in_place: list[str] = []  # in a checkpoint registered in place: located in one batch (a stat per file)
        for name in names:
            meta = self.meta(artifact_id, name)
            refs[name] = None
            if meta.nbytes and tier in ("", "memory") and self.memory.has_blob(meta.digest):
                loc: BlobLoc = self.memory.blob(meta.digest)
                if loc.arena is None:  # arena slots are reused: never mapped by callers
                    loc.segment.exported = True  # the caller may map it: its pages never hold other bytes
                    refs[name] = SegmentRef(path=loc.segment.path, size=loc.size, offset=loc.offset, tier="memory")
            elif meta.nbytes and tier in ("", "disk") and self.disk is not None and self.disk.has_blob(meta.digest):
                refs[name] = SegmentRef(path=self.disk.blob_path(meta.digest), size=meta.nbytes, tier="disk")
            elif meta.nbytes:
                in_place.append(name)
        where = self.external_locations(artifact_id, in_place) if in_place and tier in ("", "disk") else {}
        for name in in_place:
            if (ext := where.get(name)) is None:
                raise NotFound(f"tensor {clip(name)} has no {tier or 'local'} replica here")
            if not is_object_url(ext.file):  # a local file maps; an object in a store is read instead
                refs[name] = SegmentRef(path=ext.file, size=ext.nbytes, offset=ext.offset, tier="disk")
        return [refs[n] for n in names]

    def close(self) -> None:
        self.memory.close()
        with self._lock:
            for seg in self._disk_segments.values():
                seg.try_close()
            self._disk_segments.clear()
