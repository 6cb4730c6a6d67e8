"""The put protocol on a worker, with the artifact's placement applied.

Owns: ``PutBegin`` (dedup against local replicas, then the placement's decision — ``pool.placement.
decide_put``: memory after evicting, the disk tier when memory is full and the placement allows it, or a
refusal — applied: evictions made and upload targets allocated, memory ones as one pack carved out of the
pre-faulted stock), receiving bytes (same-host callers write the targets directly; remote callers stream
``PutData`` payloads straight into them), and ``PutCommit`` (digest checks for bytes that crossed a network,
storing blobs, the disk copy a durable placement requires before the put returns); a small put's bytes may
come with its ``PutBegin`` (``inline``: one request, digests computed here); a same-host put's digests may come
with its ``PutCommit`` (``digests_later``: the caller hashes while it writes; tensors whose digest it left out
then get a target each, and blobs held already are dropped at the commit; a put that memory cannot take
without making room is asked for its digests first). Dedup never trusts bytes nobody checked: a held blob that a
same-host caller wrote is checked against its digest before a put counts on it (``worker.trust``), and the
bytes a same-host caller writes are stored as unchecked ones. Abandoned puts are reclaimed. Does not own:
recording at the global store or extra replicas (``worker.storage``).
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from tensorcast import clock
from tensorcast.config import WorkerConfig
from tensorcast.errors import InvalidArgument, NotFound, Unavailable, clip
from tensorcast.limits import check_ttl
from tensorcast.pool.memory import BlobLoc
from tensorcast.pool.placement import admit_digests_later, decide_put
from tensorcast.pool.segments import Segment
from tensorcast.records import Placement, SegmentRef, TensorMeta
from tensorcast.tensors import artifact_id, digest_bytes, numpy_dtype
from tensorcast.wire.messages import PutBegin, PutData, PutPlan
from tensorcast.worker.store import LocalStore
from tensorcast.worker.trust import BlobTrust

__all__ = ["PendingPut", "PutManager", "validate_tensors"]

log = logging.getLogger("tensorcast.worker")
# Puts of at least this many new bytes that the pre-faulted stock cannot take are allocated on a thread, and
# received bytes of at least _INLINE_HASH_BYTES hashed on one: the event loop serves other requests meanwhile.
_INLINE_ALLOC_BYTES = 8 * 1024 * 1024
_INLINE_HASH_BYTES = 1024 * 1024
_DIGEST = re.compile(r"[0-9a-f]{64}")


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
    hashed_here: bool = False  # an inline put: this worker computed the digests from the bytes it stored
    digests_later: bool = False  # the digests (and so the artifact id) come with PutCommit
    memory_targets: dict[int, BlobLoc] = field(default_factory=dict)  # tensor index -> upload target
    disk_targets: dict[int, Segment] = field(default_factory=dict)
    received: dict[int, int] = field(default_factory=dict)
    started: float = field(default_factory=clock.monotonic)

    def target_view(self, index: int) -> memoryview | None:
        if index in self.memory_targets:
            return self.memory_targets[index].view()
        if index in self.disk_targets:
            return self.disk_targets[index].view()
        return None


class PutManager:
    def __init__(self, config: WorkerConfig, store: LocalStore, trust: BlobTrust) -> None:
        self.config = config
        self.store = store
        self.trust = trust
        self.pending: dict[str, PendingPut] = {}

    async def begin(self, msg: PutBegin, placement: Placement) -> PutPlan:
        later = msg.digests_later
        if later and (not msg.same_host or msg.inline):
            raise InvalidArgument("digests_later: only for a same-host put that is not inline")
        tensors = validate_tensors(msg.tensors, digests=not later)
        for t in tensors if later else ():
            if t.digest:  # stated now: deduplicated now
                _check_digest(t)
        if msg.ttl is not None:
            check_ttl(msg.ttl)
        # Digests later: the artifact's identity is not known yet, and tensors without a digest need room.
        aid = "" if later else artifact_id(tensors)
        await self.trust.ensure(t.digest for t in tensors if t.digest and t.nbytes)  # dedup onto checked bytes only
        memory = self.store.memory
        need = _distinct_bytes(t for t in tensors if t.digest and not memory.has_blob(t.digest)) + \
            sum(t.nbytes for t in tensors if not t.digest)
        state = memory.state
        if later and not admit_digests_later(placement, state, need, self.config.memory_high_watermark):
            return PutPlan(put_id="", artifact_id="", digests_first=True)
        decision = decide_put(placement, state, need, clock.time(), self.store.tiers(aid) if aid else (),
                              has_disk=self.store.disk is not None, exclude=frozenset({aid}) if aid else frozenset())
        await self.store.evict_all(decision.evict)
        put = PendingPut(put_id=uuid.uuid4().hex, artifact_id=aid, tensors=tensors, key=msg.key, ttl=msg.ttl,
                         placement=placement, stream=not msg.same_host,
                         expires=clock.time() + self.config.put_timeout,
                         to_memory=decision.to_memory, to_disk=decision.to_disk, digests_later=later)
        try:
            refs = await self._allocate_targets(put)
        except BaseException:
            self.abandon(put)
            raise
        self.pending[put.put_id] = put
        exists = not put.to_memory and not put.to_disk
        return PutPlan(put_id=put.put_id, artifact_id=aid, segments=() if exists else tuple(refs),
                       stream=put.stream, exists=exists)

    async def _allocate_targets(self, put: PendingPut) -> list[SegmentRef | None]:
        """Upload targets for the put's tensors whose bytes the chosen tier does not hold yet (each distinct
        digest once), one entry per tensor (None: nothing to write). Memory targets are one pack: carved side
        by side out of the pre-faulted stock (no first-touch faults, no chunk cut down per put) and mappable
        by callers, small tensors included."""
        memory, tensors = self.store.memory, put.tensors
        refs: list[SegmentRef | None] = [None] * len(tensors)
        seen: set[str] = set()
        new: list[int] = []
        for i, t in enumerate(tensors):
            if not t.digest:  # digests later: unknown, so new (a blob held already is dropped at the commit)
                if t.nbytes:
                    new.append(i)
            elif t.nbytes and t.digest not in seen:
                seen.add(t.digest)
                if not memory.has_blob(t.digest):
                    new.append(i)
        if put.to_memory and new:
            locs = await self._allocate_pack([tensors[i].nbytes for i in new])
            for i, loc in zip(new, locs, strict=True):
                put.memory_targets[i] = loc
                refs[i] = SegmentRef(path=loc.segment.path, size=loc.size, offset=loc.offset)
        elif put.to_disk:
            disk = self.store.require_disk()
            for i in new:
                if not tensors[i].digest or not disk.has_blob(tensors[i].digest):
                    seg = disk.new_upload(tensors[i].nbytes)
                    put.disk_targets[i] = seg
                    refs[i] = SegmentRef(path=seg.path, size=tensors[i].nbytes, tier="disk")
        return refs

    async def _allocate_pack(self, sizes: list[int]) -> list[BlobLoc]:
        """``MemoryTier.allocate_pack``; one that needs fresh segments (posix_fallocate takes milliseconds per
        100 MiB) on a thread, so the event loop serves other requests meanwhile. If this request is cancelled
        meanwhile, what the thread allocated is given back when it finishes."""
        memory = self.store.memory
        if sum(sizes) < _INLINE_ALLOC_BYTES or (max(sizes) <= memory.stock.chunk_bytes and
                                                sum(sizes) + len(sizes) * mmap.PAGESIZE <= memory.prefaulted_room()):
            return memory.allocate_pack(sizes)
        fut = asyncio.get_running_loop().run_in_executor(None, memory.allocate_pack, sizes)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            def give_back(f: asyncio.Future[list[BlobLoc]]) -> None:
                if not f.cancelled() and f.exception() is None:
                    for loc in f.result():
                        memory.discard(loc)

            fut.add_done_callback(give_back)
            raise

    def inline_sink(self, msg: PutBegin) -> None:
        """Where an inline put's payload goes: a fresh buffer of the connection's (bounded by
        ``wire.max_unsolicited_payload_bytes``); other puts take none."""
        if not msg.inline:
            raise InvalidArgument("PutBegin takes a payload only with inline=True")

    async def begin_inline(self, msg: PutBegin, placement: Placement, payload: memoryview | None) -> PutPlan:
        """A small put in one request: its bytes came as the payload, tensor after tensor. The digests are
        computed here from those bytes (one the caller sent must match), the put begins as any other, and the
        bytes are copied into its targets; the caller (``worker.storage``) commits it next."""
        validate_tensors(msg.tensors, digests=False)
        data = memoryview(payload if payload is not None else b"").cast("B")
        if sum(t.nbytes for t in msg.tensors) != len(data):
            raise InvalidArgument(f"inline put: {len(data)} payload bytes for tensors of "
                                  f"{sum(t.nbytes for t in msg.tensors)}")
        views: dict[str, memoryview] = {}
        metas: list[TensorMeta] = []
        for t in msg.tensors:
            views[t.name], data = data[: t.nbytes], data[t.nbytes :]
            digest = digest_bytes(views[t.name])
            if t.digest and t.digest != digest:
                raise InvalidArgument(f"tensor {clip(t.name)}: content digest mismatch; nothing was stored")
            metas.append(msgspec.structs.replace(t, digest=digest))
        # The bytes came over the connection (stream=True), and were hashed here (nothing to check at commit).
        plan = await self.begin(msgspec.structs.replace(msg, tensors=tuple(metas), same_host=False, inline=False),
                                placement)
        put = self.pending[plan.put_id]
        put.hashed_here = True
        try:
            for i, t in enumerate(put.tensors):
                target = put.target_view(i)
                if target is not None:
                    target[:] = views[t.name]
                    put.received[i] = t.nbytes
        except BaseException:
            self.abandon(put)
            raise
        return plan

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

    async def commit(self, put_id: str, digests: tuple[str, ...] = ()) -> PendingPut:
        """Store the put's bytes locally as its placement says (``digests``: those of a put begun with
        ``digests_later``); the caller records it at the GS."""
        put = self.get(put_id)
        del self.pending[put.put_id]
        memory = self.store.memory
        try:
            later = put.digests_later or bool(digests)
            if later:
                _take_digests(put, digests)
            verified = await self._check_received(put)
            # Blobs held already are checked before this put counts on them (racing puts may store some until
            # the last await): from here to the blobs' commit nothing awaits, and blobs stored while the disk
            # copies are written are checked before the replica is recorded.
            blobs = tuple(t.digest for t in put.tensors if t.nbytes)
            await self.trust.settle(blobs)
            if later:
                # Now that its identity is known: tiers holding the artifact already are left as they are, as
                # the placement's decision at PutBegin would have left them (``decide_put``).
                present = self.store.tiers(put.artifact_id)
                put.to_memory = put.to_memory and "memory" not in present
                put.to_disk = put.to_disk and "disk" not in present
            for i, loc in put.memory_targets.items():
                memory.commit_blob(put.tensors[i].digest, loc, verified)
            put.memory_targets.clear()
            committed = {d: memory.held(d) for d in blobs}
            disk = self.store.disk
            for i, seg in put.disk_targets.items():
                assert disk is not None
                await asyncio.to_thread(disk.commit_upload, put.tensors[i].digest, seg, verified)
            put.disk_targets.clear()
            if put.to_memory:
                await self.trust.settle(d for d in blobs if memory.held(d) is not committed[d])  # stored meanwhile
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

    async def _check_received(self, put: PendingPut) -> bool:
        """Check the bytes a put handed over; True when they were hashed here (streamed ones, inline ones, and a
        same-host caller's with ``worker.verify_local_puts``), False when they are the same-host caller's word."""
        verify = (put.stream and not put.hashed_here) or self.config.verify_local_puts
        for i in [*put.memory_targets, *put.disk_targets]:
            meta = put.tensors[i]
            if put.stream and put.received.get(i, 0) != meta.nbytes:
                raise InvalidArgument(f"tensor {clip(meta.name)}: received {put.received.get(i, 0)} of "
                                      f"{meta.nbytes} bytes")
            view = put.target_view(i)
            assert view is not None
            if verify and await _digest(view) != meta.digest:
                raise InvalidArgument(f"tensor {clip(meta.name)}: content digest mismatch (bytes corrupted or "
                                      "written incompletely); nothing was stored")
        return verify or put.hashed_here

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


async def _digest(view: memoryview) -> str:
    """The BLAKE3 digest of received bytes: on a thread, unless they are few (a thread hop costs more)."""
    return digest_bytes(view) if len(view) < _INLINE_HASH_BYTES else await asyncio.to_thread(digest_bytes, view)


def _distinct_bytes(tensors: Iterable[TensorMeta]) -> int:
    seen: dict[str, int] = {}
    for t in tensors:
        seen[t.digest] = t.nbytes
    return sum(seen.values())


def _take_digests(put: PendingPut, digests: tuple[str, ...]) -> None:
    """Give a put begun with ``digests_later`` its digests and identity. A blob held already (or twice in
    this put) is dropped when committed (``MemoryTier.commit_blob``, ``DiskTier.commit_upload``)."""
    if not put.digests_later:
        raise InvalidArgument(f"put {put.put_id}: digests come with the commit only after digests_later")
    if len(digests) != len(put.tensors):
        raise InvalidArgument(f"put {put.put_id}: {len(digests)} digests for {len(put.tensors)} tensors")
    for t, d in zip(put.tensors, digests, strict=True):
        if t.digest and d != t.digest:
            raise InvalidArgument(f"tensor {clip(t.name)}: the digest at the commit is not the one PutBegin stated")
    put.tensors = tuple(msgspec.structs.replace(t, digest=d) for t, d in zip(put.tensors, digests, strict=True))
    for t in put.tensors:
        _check_digest(t)
    put.artifact_id = artifact_id(put.tensors)
    put.digests_later = False


def validate_tensors(tensors: tuple[TensorMeta, ...], digests: bool = True) -> tuple[TensorMeta, ...]:
    """Check a put's tensor list (``digests=False``: all but the digests, which come later); return it
    sorted by name."""
    if not tensors:
        raise InvalidArgument("an artifact needs at least one tensor")
    names = [t.name for t in tensors]
    if len(set(names)) != len(names) or not all(names):
        raise InvalidArgument("tensor names must be unique and non-empty")
    for t in tensors:
        itemsize = numpy_dtype(t.dtype).itemsize
        numel = 1
        for s in t.shape:
            if s < 0:
                raise InvalidArgument(f"tensor {clip(t.name)}: negative dimension in shape {t.shape}")
            numel *= s
        if numel * itemsize != t.nbytes:
            raise InvalidArgument(f"tensor {clip(t.name)}: {t.nbytes} bytes do not match shape {t.shape} of {t.dtype}")
        if digests:
            _check_digest(t)
    return tuple(sorted(tensors, key=lambda t: t.name))


def _check_digest(t: TensorMeta) -> None:
    if _DIGEST.fullmatch(t.digest) is None:
        raise InvalidArgument(f"tensor {clip(t.name)}: digest must be 64 lowercase hex characters")
