"""The worker process: the basic role (memory tier, put/get/map/stat) and the gateway role (the caller's
entry point: forwards metadata calls to the global store).

Owns: the put protocol (begin -> bytes via shared memory or payload frames -> commit, with digests
verified for bytes that crossed a network), serving reads (same-host segment names to map, or payload
frames), registering with the GS, heartbeats (which also deliver deletions and expired leases to drop),
and reclaiming abandoned puts. Does not own: accounting (``pool``), framing (``wire``), metadata (``gs``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tensorcast.config import Config, default_host_id
from tensorcast.context import CallContext
from tensorcast.errors import InvalidArgument, NotFound, TensorCastError, Unavailable
from tensorcast.pool.memory import MemoryPool
from tensorcast.pool.segments import Segment
from tensorcast.tensors import artifact_id, digest_bytes, numpy_dtype
from tensorcast.wire.connection import Connection
from tensorcast.wire.messages import (
    Ack,
    ArtifactInfo,
    CommitArtifact,
    DeleteArtifact,
    Deleted,
    DropArtifact,
    GetArtifact,
    Heartbeat,
    HeartbeatReply,
    ListArtifacts,
    ListWorkers,
    Mapped,
    MapTensors,
    PutAbort,
    PutBegin,
    PutCommit,
    PutData,
    PutDone,
    PutPlan,
    ReadTensor,
    Registered,
    RegisterWorker,
    ReleaseLease,
    RenewLease,
    SegmentRef,
    TensorMeta,
    WorkerInfo,
)
from tensorcast.wire.rpc import HandlerRegistry, Reply, Request, RpcChannel, RpcServer

__all__ = ["Worker", "run_worker"]

log = logging.getLogger("tensorcast.worker")
ROLES = frozenset({"basic", "gateway"})


@dataclass
class PendingPut:
    put_id: str
    artifact_id: str
    tensors: tuple[TensorMeta, ...]
    key: str | None
    ttl: float | None
    stream: bool
    expires: float
    segments: dict[int, Segment] = field(default_factory=dict)  # tensor index -> upload target
    received: dict[int, int] = field(default_factory=dict)  # tensor index -> payload bytes received
    exists: bool = False


class Worker:
    def __init__(self, config: Config, worker_id: str, gs_address: str) -> None:
        roles = set(config.worker.roles) | {"basic"}
        unknown = roles - ROLES
        if unknown:
            raise InvalidArgument(f"unknown worker roles {sorted(unknown)}; known: {sorted(ROLES)}")
        self.config = config
        self.worker_id = worker_id
        self.roles = tuple(sorted(roles))
        self.host_id = config.worker.host_id or default_host_id()
        self.pool = MemoryPool(config.worker.memory_capacity, f"{config.worker.shm_prefix}-{worker_id}")
        self.gs = RpcChannel(gs_address, config.wire, token=config.token, peer_id=worker_id, host_id=self.host_id)
        self.incarnation = 0
        self.address = ""
        self._puts: dict[str, PendingPut] = {}
        self._dropped: set[str] = set()
        self.registry = HandlerRegistry()
        self._register_handlers()
        self.server = RpcServer(self.registry, config.wire, token=config.token, server_id=worker_id,
                                host_id=self.host_id, roles=self.roles)
        self._tasks: list[asyncio.Task[None]] = []

    def _register_handlers(self) -> None:
        r = self.registry
        r.register(PutBegin, self.put_begin)
        r.register(PutData, self.put_data, sink=self.put_data_sink)
        r.register(PutCommit, self.put_commit)
        r.register(PutAbort, self.put_abort)
        r.register(MapTensors, self.map_tensors)
        r.register(ReadTensor, self.read_tensor)
        r.register(DropArtifact, self.drop_artifact)
        # Metadata calls: answered by the GS; every worker forwards them so any worker can be an entry
        # point, but only gateways are advertised to callers.
        for msg_type in (GetArtifact, ListArtifacts, ListWorkers, RenewLease):
            r.register(msg_type, self.forward)
        r.register(DeleteArtifact, self.delete)
        r.register(ReleaseLease, self.delete)

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> str:
        cfg = self.config.worker
        self.address = await self.server.start(cfg.host, cfg.port)
        await self._register(deadline=time.time() + 30.0)
        self._tasks.append(asyncio.ensure_future(self._heartbeat_loop()))
        self._tasks.append(asyncio.ensure_future(self._reap_loop()))
        log.info("worker %s serving at %s roles=%s memory=%d", self.worker_id, self.address,
                 ",".join(self.roles), cfg.memory_capacity)
        return self.address

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await self.server.close()
        await self.gs.close()
        for put in list(self._puts.values()):
            self._abandon(put)
        self.pool.close()

    def info(self) -> WorkerInfo:
        return WorkerInfo(
            worker_id=self.worker_id, address=self.address, host_id=self.host_id, roles=self.roles,
            pid=os.getpid(), incarnation=self.incarnation, memory_used=self.pool.state.used,
            memory_capacity=self.pool.state.capacity, artifacts=len(self.pool.artifact_ids()),
        )

    async def _register(self, deadline: float) -> None:
        while True:
            try:
                frame = await self.gs.call(RegisterWorker(worker=self.info()), CallContext(deadline=time.time() + 5))
                assert isinstance(frame.message, Registered)
                self.incarnation = frame.message.incarnation
                # Replicas we still hold (the GS database was replaced): announce them again.
                for aid in self.pool.artifact_ids():
                    await self._commit_to_gs(ArtifactInfo(id=aid, tensors=self.pool.tensors(aid),
                                                          nbytes=_nbytes(self.pool.tensors(aid))), None, None,
                                             CallContext(deadline=time.time() + 5))
                return
            except TensorCastError as exc:
                if time.time() > deadline:
                    raise Unavailable(f"cannot register with the global store: {exc}") from exc
                await asyncio.sleep(0.2)

    async def _heartbeat_loop(self) -> None:
        interval = self.config.worker.heartbeat_interval
        while True:
            await asyncio.sleep(interval)
            dropped = tuple(self._dropped)
            try:
                frame = await self.gs.call(
                    Heartbeat(worker_id=self.worker_id, incarnation=self.incarnation,
                              memory_used=self.pool.state.used, memory_capacity=self.pool.state.capacity,
                              artifacts=len(self.pool.artifact_ids()), dropped=dropped),
                    CallContext(deadline=time.time() + max(interval * 3, 2.0)))
            except TensorCastError as exc:
                log.warning("heartbeat to the global store failed: %s", exc)
                continue
            reply = frame.message
            assert isinstance(reply, HeartbeatReply)
            self._dropped.difference_update(dropped)
            if reply.reregister:
                log.warning("the global store does not know this worker: registering again")
                with contextlib.suppress(TensorCastError):
                    await self._register(deadline=time.time() + 5)
                continue
            for aid in reply.drop:
                self._drop(aid)

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.time()
            for put in [p for p in self._puts.values() if p.expires < now]:
                log.warning("reclaiming abandoned put %s of artifact %s", put.put_id, put.artifact_id)
                self._abandon(put)
            self.pool.collect()

    # ----------------------------------------------------------------- put
    async def put_begin(self, msg: PutBegin, req: Request) -> PutPlan:
        tensors = validate_tensors(msg.tensors)
        if msg.ttl is not None and msg.ttl <= 0:
            raise InvalidArgument(f"ttl must be > 0 seconds, got {msg.ttl}")
        aid = artifact_id(tensors)
        put = PendingPut(put_id=uuid.uuid4().hex, artifact_id=aid, tensors=tensors, key=msg.key, ttl=msg.ttl,
                         stream=not msg.same_host, expires=time.time() + self.config.worker.put_timeout)
        refs: list[SegmentRef | None] = []
        if self.pool.has_artifact(aid):
            put.exists = True
        else:
            seen: set[str] = set()
            try:
                for i, t in enumerate(tensors):
                    if t.nbytes == 0 or t.digest in seen or self.pool.has_blob(t.digest):
                        refs.append(None)
                        continue
                    seen.add(t.digest)
                    seg = self.pool.allocate(t.nbytes)
                    put.segments[i] = seg
                    refs.append(SegmentRef(name=seg.name, size=seg.size))
            except BaseException:
                self._abandon(put)
                raise
        self._puts[put.put_id] = put
        return PutPlan(put_id=put.put_id, artifact_id=aid, segments=tuple(refs), stream=put.stream,
                       exists=put.exists)

    def _pending(self, put_id: str) -> PendingPut:
        put = self._puts.get(put_id)
        if put is None:
            raise NotFound(f"no put {put_id} in progress (committed, aborted or expired)")
        return put

    def put_data_sink(self, msg: PutData, conn: Connection) -> memoryview:
        put = self._pending(msg.put_id)
        seg = put.segments.get(msg.index)
        if seg is None:
            raise InvalidArgument(f"put {msg.put_id}: tensor {msg.index} takes no upload")
        if msg.offset < 0 or msg.offset > seg.size:
            raise InvalidArgument(f"put {msg.put_id}: offset {msg.offset} outside tensor {msg.index}")
        return seg.view()[msg.offset :]

    async def put_data(self, msg: PutData, req: Request) -> Ack:
        put = self._pending(msg.put_id)
        assert req.payload is not None
        put.received[msg.index] = put.received.get(msg.index, 0) + req.payload.nbytes
        return Ack()

    async def put_commit(self, msg: PutCommit, req: Request) -> PutDone:
        put = self._pending(msg.put_id)
        del self._puts[put.put_id]
        try:
            verify = put.stream or self.config.worker.verify_local_puts
            for i, seg in put.segments.items():
                meta = put.tensors[i]
                if put.stream and put.received.get(i, 0) != meta.nbytes:
                    raise InvalidArgument(f"tensor {meta.name!r}: received {put.received.get(i, 0)} of "
                                          f"{meta.nbytes} bytes")
                if verify:
                    got = await asyncio.to_thread(digest_bytes, seg.view())
                    if got != meta.digest:
                        raise InvalidArgument(f"tensor {meta.name!r}: content digest mismatch (bytes corrupted "
                                              "or written incompletely); nothing was stored")
            for i, seg in put.segments.items():
                self.pool.commit_blob(put.tensors[i].digest, seg)
            put.segments.clear()
            missing = [t.name for t in put.tensors if t.nbytes and not self.pool.has_blob(t.digest)]
            if missing:  # a blob we counted on for dedup went away meanwhile
                raise Unavailable(f"tensors {missing} were evicted during the put; retry it")
            self.pool.add_artifact(put.artifact_id, put.tensors)
        except BaseException:
            self._abandon(put)
            self.pool.release_unreferenced()
            raise
        self._dropped.discard(put.artifact_id)
        info = ArtifactInfo(id=put.artifact_id, tensors=put.tensors, nbytes=_nbytes(put.tensors))
        done = await self._commit_to_gs(info, put.key, put.ttl, req.ctx)
        log.info("stored artifact %s (%d bytes)%s", put.artifact_id, info.nbytes,
                 f" key={put.key}" if put.key else "")
        return PutDone(artifact=done)

    async def _commit_to_gs(self, info: ArtifactInfo, key: str | None, ttl: float | None,
                            ctx: CallContext) -> ArtifactInfo:
        frame = await self.gs.call(CommitArtifact(artifact=info, worker_id=self.worker_id, key=key, ttl=ttl), ctx)
        assert isinstance(frame.message, ArtifactInfo)
        return frame.message

    async def put_abort(self, msg: PutAbort, req: Request) -> Ack:
        put = self._puts.get(msg.put_id)
        if put is not None:
            self._abandon(put)
        return Ack()

    def _abandon(self, put: PendingPut) -> None:
        self._puts.pop(put.put_id, None)
        for seg in put.segments.values():
            self.pool.discard(seg)
        put.segments.clear()

    # ----------------------------------------------------------------- read
    async def map_tensors(self, msg: MapTensors, req: Request) -> Mapped:
        tensors = self.pool.tensors(msg.artifact_id)
        wanted = msg.names or tuple(t.name for t in tensors)
        by_name = {t.name: t for t in tensors}
        refs: list[SegmentRef | None] = []
        for name in wanted:
            meta = by_name.get(name)
            if meta is None:
                raise NotFound(f"artifact {msg.artifact_id} has no tensor {name!r}")
            if meta.nbytes == 0:
                refs.append(None)
            else:
                seg = self.pool.segment(meta.digest)
                refs.append(SegmentRef(name=seg.name, size=seg.size))
        return Mapped(segments=tuple(refs))

    async def read_tensor(self, msg: ReadTensor, req: Request) -> Reply:
        meta = next((t for t in self.pool.tensors(msg.artifact_id) if t.name == msg.name), None)
        if meta is None:
            raise NotFound(f"artifact {msg.artifact_id} has no tensor {msg.name!r}")
        length = meta.nbytes - msg.offset if msg.length < 0 else msg.length
        if msg.offset < 0 or length < 0 or msg.offset + length > meta.nbytes:
            raise InvalidArgument(f"range [{msg.offset}, {msg.offset + length}) outside tensor {msg.name!r} "
                                  f"of {meta.nbytes} bytes")
        if length == 0:
            return Reply(Ack())
        seg = self.pool.segment(meta.digest)
        seg.readers += 1  # read lease: the segment stays mapped until the payload is written

        def done() -> None:
            seg.readers -= 1

        return Reply(Ack(), payload=seg.view()[msg.offset : msg.offset + length], on_sent=done)

    # ----------------------------------------------------------------- metadata
    async def forward(self, msg: Any, req: Request) -> Any:
        frame = await self.gs.call(msg, req.ctx)
        return frame.message

    async def delete(self, msg: DeleteArtifact | ReleaseLease, req: Request) -> Deleted:
        frame = await self.gs.call(msg, req.ctx)
        reply = frame.message
        assert isinstance(reply, Deleted)
        # Free our own copy now; other holders drop it at their next heartbeat.
        self._drop(reply.artifact_id)
        return reply

    async def drop_artifact(self, msg: DropArtifact, req: Request) -> Ack:
        self._drop(msg.artifact_id)
        return Ack()

    def _drop(self, aid: str) -> None:
        self.pool.remove_artifact(aid)
        self._dropped.add(aid)


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
            raise InvalidArgument(f"tensor {t.name!r}: negative dimension in shape {t.shape}")
        numel = 1
        for s in t.shape:
            numel *= s
        if numel * itemsize != t.nbytes:
            raise InvalidArgument(f"tensor {t.name!r}: {t.nbytes} bytes do not match shape {t.shape} of "
                                  f"{t.dtype}")
        if len(t.digest) != 64 or any(c not in "0123456789abcdef" for c in t.digest):
            raise InvalidArgument(f"tensor {t.name!r}: digest must be 64 lowercase hex characters")
    return tuple(sorted(tensors, key=lambda t: t.name))


def _nbytes(tensors: tuple[TensorMeta, ...]) -> int:
    return sum(t.nbytes for t in tensors)


async def run_worker(config: Config, worker_id: str, gs_address: str, ready_file: Path | None = None,
                     stop: asyncio.Event | None = None) -> None:
    worker = Worker(config, worker_id, gs_address)
    try:
        address = await worker.start()
        if ready_file is not None:
            tmp = ready_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({"worker_id": worker_id, "address": address, "pid": os.getpid(),
                                       "host_id": worker.host_id, "roles": list(worker.roles)}))
            tmp.replace(ready_file)
        await (stop.wait() if stop is not None else asyncio.Event().wait())
    finally:
        await worker.stop()
