"""The put protocol on a worker, with the artifact's placement applied.

Owns: ``PutBegin`` (dedup against local replicas, then the placement's decision — ``pool.placement.
decide_put``: memory after evicting, the disk tier when memory is full and the placement allows it, or a
refusal — applied: evictions made and upload targets allocated), receiving
bytes (same-host callers write the targets directly; remote callers stream ``PutData`` payloads straight
into them), and ``PutCommit`` (digest checks for bytes that crossed a network, storing blobs, the disk
copy a durable placement requires before the put returns). Abandoned puts are reclaimed. Does not own:
recording at the global store or extra replicas (``worker.server``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

from tensorcast.config import WorkerConfig
from tensorcast.errors import InvalidArgument, NotFound, Unavailable, clip
from tensorcast.limits import check_ttl
from tensorcast.pool.memory import BlobLoc
from tensorcast.pool.placement import decide_put
from tensorcast.pool.segments import Segment
from tensorcast.records import Placement, SegmentRef, TensorMeta
from tensorcast.tensors import artifact_id, digest_bytes, numpy_dtype
from tensorcast.wire.messages import PutBegin, PutData, PutPlan
from tensorcast.worker.store import LocalStore

__all__ = ["PendingPut", "PutManager", "validate_tensors"]

log = logging.getLogger("tensorcast.worker")


@dataclass
class PendingPut:
    put_id: str
    artifact_id: str
    tensors: tuple[TensorMeta, ...]
    key: str | None
    ttl: float | None
    placement: Placement
    stream: bool
    expires: float
    to_memory: bool
    to_disk: bool
    memory_targets: dict[int, BlobLoc] = field(default_factory=dict)  # tensor index -> upload target
    disk_targets: dict[int, Segment] = field(default_factory=dict)
    received: dict[int, int] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)

    def target_view(self, index: int) -> memoryview | None:
        if index in self.memory_targets:
            return self.memory_targets[index].view()
        if index in self.disk_targets:
            return self.disk_targets[index].view()
        return None


class PutManager:
    def __init__(self, config: WorkerConfig, store: LocalStore) -> None:
        self.config = config
        self.store = store
        self.pending: dict[str, PendingPut] = {}

    async def begin(self, msg: PutBegin, placement: Placement) -> PutPlan:
        tensors = validate_tensors(msg.tensors)
        if msg.ttl is not None:
            check_ttl(msg.ttl)
        aid = artifact_id(tensors)
        memory = self.store.memory
        need = _distinct_bytes(t for t in tensors if not memory.has_blob(t.digest))
        decision = decide_put(placement, memory.state, need, time.time(), self.store.tiers(aid),
                              has_disk=self.store.disk is not None, exclude=frozenset({aid}))
        await self.store.evict_all(decision.evict)
        put = PendingPut(put_id=uuid.uuid4().hex, artifact_id=aid, tensors=tensors, key=msg.key, ttl=msg.ttl,
                         placement=placement, stream=not msg.same_host,
                         expires=time.time() + self.config.put_timeout,
                         to_memory=decision.to_memory, to_disk=decision.to_disk)
        refs: list[SegmentRef | None] = []
        seen: set[str] = set()
        try:
            for i, t in enumerate(tensors):
                ref = None
                if t.nbytes and t.digest not in seen:
                    seen.add(t.digest)
                    if put.to_memory and not memory.has_blob(t.digest):
                        loc = memory.allocate(t.nbytes)
                        put.memory_targets[i] = loc
                        ref = SegmentRef(path=loc.segment.path, size=t.nbytes, offset=loc.offset)
                    elif (put.to_disk and not put.to_memory and not memory.has_blob(t.digest)
                          and not self.store.require_disk().has_blob(t.digest)):
                        seg = self.store.require_disk().new_upload(t.nbytes)
                        put.disk_targets[i] = seg
                        ref = SegmentRef(path=seg.path, size=t.nbytes, tier="disk")
                refs.append(ref)
        except BaseException:
            self.abandon(put)
            raise
        self.pending[put.put_id] = put
        exists = not put.to_memory and not put.to_disk
        return PutPlan(put_id=put.put_id, artifact_id=aid, segments=() if exists else tuple(refs),
                       stream=put.stream, exists=exists)

    def get(self, put_id: str) -> PendingPut:
        put = self.pending.get(put_id)
        if put is None:
            raise NotFound(f"no put {put_id} in progress (committed, aborted or expired)")
        return put

    def data_sink(self, msg: PutData) -> memoryview:
        put = self.get(msg.put_id)
        view = put.target_view(msg.index)
        if view is None:
            raise InvalidArgument(f"put {msg.put_id}: tensor {msg.index} takes no upload")
        if msg.offset < 0 or msg.offset > len(view):
            raise InvalidArgument(f"put {msg.put_id}: offset {msg.offset} outside tensor {msg.index}")
        return view[msg.offset :]

    def data_received(self, msg: PutData, nbytes: int) -> None:
        put = self.get(msg.put_id)
        put.received[msg.index] = put.received.get(msg.index, 0) + nbytes

    async def commit(self, put_id: str) -> PendingPut:
        """Store the put's bytes locally as its placement says; the caller records it at the GS."""
        put = self.get(put_id)
        del self.pending[put.put_id]
        memory = self.store.memory
        try:
            verify = put.stream or self.config.verify_local_puts
            for i in [*put.memory_targets, *put.disk_targets]:
                meta = put.tensors[i]
                if put.stream and put.received.get(i, 0) != meta.nbytes:
                    raise InvalidArgument(f"tensor {clip(meta.name)}: received {put.received.get(i, 0)} of "
                                          f"{meta.nbytes} bytes")
                view = put.target_view(i)
                assert view is not None
                if verify and await asyncio.to_thread(digest_bytes, view) != meta.digest:
                    raise InvalidArgument(f"tensor {clip(meta.name)}: content digest mismatch (bytes corrupted or "
                                          "written incompletely); nothing was stored")
            for i, loc in put.memory_targets.items():
                memory.commit_blob(put.tensors[i].digest, loc)
            put.memory_targets.clear()
            disk = self.store.disk
            for i, seg in put.disk_targets.items():
                assert disk is not None
                await asyncio.to_thread(disk.commit_upload, put.tensors[i].digest, seg)
            put.disk_targets.clear()
            if put.to_memory:
                missing = [t.name for t in put.tensors if t.nbytes and not memory.has_blob(t.digest)]
                if missing:  # a blob we counted on for dedup was evicted meanwhile
                    raise Unavailable(f"tensors {missing} were evicted during the put; retry it")
                self.store.add_memory_replica(put.artifact_id, put.tensors, put.placement)
            if put.to_disk:  # blobs not uploaded to disk are copied from memory
                await asyncio.to_thread(self.store.copy_to_disk, put.artifact_id, put.tensors, put.placement.name)
        except BaseException:
            self.abandon(put)
            memory.release_unreferenced()
            raise
        return put

    def abandon(self, put: PendingPut) -> None:
        self.pending.pop(put.put_id, None)
        for loc in put.memory_targets.values():
            self.store.memory.discard(loc)
        put.memory_targets.clear()
        for seg in put.disk_targets.values():
            assert self.store.disk is not None
            self.store.disk.discard_upload(seg)
        put.disk_targets.clear()

    def reap(self, now: float) -> None:
        for put in [p for p in self.pending.values() if p.expires < now]:
            log.warning("reclaiming abandoned put %s of artifact %s", put.put_id, put.artifact_id)
            self.abandon(put)


def _distinct_bytes(tensors: Iterable[TensorMeta]) -> int:
    seen: dict[str, int] = {}
    for t in tensors:
        seen[t.digest] = t.nbytes
    return sum(seen.values())


def validate_tensors(tensors: tuple[TensorMeta, ...]) -> tuple[TensorMeta, ...]:
    """Check a put's tensor list; return it sorted by name."""
    if not tensors:
        raise InvalidArgument("an artifact needs at least one tensor")
    names = [t.name for t in tensors]
    if len(set(names)) != len(names) or not all(names):
        raise InvalidArgument("tensor names must be unique and non-empty")
    for t in tensors:
        itemsize = numpy_dtype(t.dtype).itemsize
        if any(s < 0 for s in t.shape):
            raise InvalidArgument(f"tensor {clip(t.name)}: negative dimension in shape {t.shape}")
        numel = 1
        for s in t.shape:
            numel *= s
        if numel * itemsize != t.nbytes:
            raise InvalidArgument(f"tensor {clip(t.name)}: {t.nbytes} bytes do not match shape {t.shape} of {t.dtype}")
        if len(t.digest) != 64 or any(c not in "0123456789abcdef" for c in t.digest):
            raise InvalidArgument(f"tensor {clip(t.name)}: digest must be 64 lowercase hex characters")
    return tuple(sorted(tensors, key=lambda t: t.name))
