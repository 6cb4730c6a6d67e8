"""The worker process: RPC surface, lifecycle and global-store bookkeeping of the basic and gateway roles.

Owns: registering with the GS (re-announcing disk replicas after a restart), heartbeats (which also
deliver deletions and expired leases to drop), the control handlers (put, map, prefetch, pin, unpin,
drop), routing a request aimed at another worker to it (any worker can be an entry point), forwarding
metadata calls to the GS, the data-plane server beside the RPC server, extra replicas for placements that
want them, and housekeeping (abandoned puts, cold TTLs, watermarks). Does not own: the put protocol
(``worker.puts``), pulling replicas (``worker.fetch``) or local replica state (``worker.store``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import blake3

from tensorcast.config import Config, default_host_id
from tensorcast.context import CallContext
from tensorcast.errors import InvalidArgument, NotFound, TensorCastError, Unavailable
from tensorcast.kv.home import ShardHome
from tensorcast.plans.executor import PlanExecutor
from tensorcast.pool.device import DeviceTier, check_device
from tensorcast.pool.placement import resolve_placement
from tensorcast.tensors import ARTIFACT_ID_RE, artifact_id, wrap_bytes
from tensorcast.transport.cuda_ipc import export_handle
from tensorcast.transport.h2d import to_device
from tensorcast.transport.tcp import DataServer, TcpTransport
from tensorcast.weights.safetensors import Checkpoint, CheckpointTensor, open_checkpoint
from tensorcast.wire.messages import (
    Ack,
    AddReplica,
    ArtifactInfo,
    CommitArtifact,
    DeleteArtifact,
    Deleted,
    DropArtifact,
    Evict,
    GetArtifact,
    GSStats,
    Heartbeat,
    HeartbeatReply,
    InstanceCall,
    InstanceHeartbeat,
    InstanceList,
    InstanceReply,
    ListArtifacts,
    ListInstances,
    ListShards,
    ListWorkers,
    Mapped,
    MapTensors,
    PageIndexGet,
    PageIndexPut,
    PlanResult,
    Prefetch,
    Prefetched,
    PutAbort,
    PutBegin,
    PutCommit,
    PutData,
    PutDone,
    PutPlan,
    RegisterCheckpoint,
    Registered,
    RegisterInstance,
    RegisterWorker,
    ReleaseLease,
    RemoveReplica,
    RenewLease,
    RunPlan,
    TensorMeta,
    Unpin,
    WorkerInfo,
    WorkerList,
)
from tensorcast.wire.rpc import HandlerRegistry, Request, RpcChannel, RpcServer
from tensorcast.worker.fetch import Fetcher
from tensorcast.worker.puts import PutManager
from tensorcast.worker.store import LocalStore

__all__ = ["Worker", "run_worker"]

log = logging.getLogger("tensorcast.worker")
ROLES = frozenset({"basic", "gateway", "shard-home"})


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
        self.store = LocalStore(config.worker, worker_id, self._replica_gone)
        self.puts = PutManager(config.worker, self.store)
        self.transport = TcpTransport(config.wire, token=config.token, max_streams=config.transport.max_streams * 2)
        self.fetcher = Fetcher(worker_id, self.store, self.transport, config.transport)
        self.devices = DeviceTier(config.worker.device_capacity)
        self._last_busy = 0.0  # monotonic time a put, fetch or send was last seen running
        self.data_server = DataServer(self.store.open_source, config.wire, token=config.token,
                                      corrupt_chunks=config.worker.fault_corrupt_chunks)
        self.gs = RpcChannel(gs_address, config.wire, token=config.token, peer_id=worker_id, host_id=self.host_id)
        self._peers: dict[str, RpcChannel] = {}
        self._peer_addresses: dict[str, str] = {}
        self.incarnation = 0
        self.address = ""
        self.bytes_in = 0  # payload and fetched bytes received, for the network-pressure signal
        self._net_mark = (time.time(), 0, 0)
        self._dropped: set[str] = set()
        self.plans = PlanExecutor(self, max_attempts=config.worker.plan_max_attempts)
        self.kv_home = ShardHome(worker_id, config.kv, self.gs, f"{config.worker.shm_prefix}-{worker_id}") \
            if "shard-home" in self.roles else None
        self._instances: dict[str, RpcChannel] = {}
        self.registry = HandlerRegistry()
        self._register_handlers()
        self.server = RpcServer(self.registry, config.wire, token=config.token, server_id=worker_id,
                                host_id=self.host_id, roles=self.roles)
        self._tasks: list[asyncio.Task[None]] = []
        # Pre-faulting the stock and giving back pack tails: one thread that runs only on idle CPU, so that
        # it never slows the engine that just loaded its weights (a 2-core host has no CPU to spare).
        self._background = ThreadPoolExecutor(1, thread_name_prefix="tensorcast-prefault",
                                              initializer=_idle_priority)

    def _register_handlers(self) -> None:
        r = self.registry
        r.register(PutBegin, self.put_begin)
        r.register(PutData, self.put_data, sink=lambda msg, conn: self.puts.data_sink(msg))
        r.register(PutCommit, self.put_commit)
        r.register(PutAbort, self.put_abort)
        r.register(MapTensors, self.map_tensors)
        r.register(Prefetch, self.prefetch)
        r.register(Unpin, self.unpin)
        r.register(Evict, self.evict)
        r.register(RegisterCheckpoint, self.register_checkpoint)
        r.register(DropArtifact, self.drop_artifact)
        # Metadata calls are answered by the GS; every worker forwards them so any worker is an entry point.
        forwarded: tuple[type, ...] = (GetArtifact, ListArtifacts, ListWorkers, RenewLease, RegisterInstance,
                                       InstanceHeartbeat, ListInstances, ListShards, GSStats, PageIndexPut,
                                       PageIndexGet)
        for msg_type in forwarded:
            r.register(msg_type, self.forward)
        r.register(DeleteArtifact, self.delete)
        r.register(ReleaseLease, self.delete)
        r.register(InstanceCall, self.call_instance)
        if "gateway" in self.roles:
            r.register(RunPlan, self.run_plan)
        if self.kv_home is not None:
            self.kv_home.register(r)

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> str:
        cfg = self.config.worker
        self.address = await self.server.start(cfg.host, cfg.port)
        self.data_server.start(cfg.host, 0)
        await self._register(deadline=time.time() + 30.0)
        self._tasks.append(asyncio.ensure_future(self._heartbeat_loop()))
        self._tasks.append(asyncio.ensure_future(self._housekeeping_loop()))
        if self.kv_home is not None:
            self.kv_home.start()
        log.info("worker %s serving at %s (data %s) roles=%s memory=%d disk=%s", self.worker_id, self.address,
                 self.data_server.address, ",".join(self.roles), cfg.memory_capacity, cfg.disk_dir or "-")
        return self.address

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self.kv_home is not None:
            self.kv_home.stop()
        await self.server.close()
        self.data_server.close()
        self.transport.close()
        await self.gs.close()
        for ch in [*self._peers.values(), *self._instances.values()]:
            await ch.close()
        for put in list(self.puts.pending.values()):
            self.puts.abandon(put)
        self.store.close()  # a refill in progress stops after its current segment
        self._background.shutdown(wait=True)

    def info(self) -> WorkerInfo:
        s = self.store.stats()
        return WorkerInfo(
            worker_id=self.worker_id, address=self.address, host_id=self.host_id, roles=self.roles,
            pid=os.getpid(), incarnation=self.incarnation, data_address=self.data_server.address,
            memory_used=s["memory_used"], memory_capacity=s["memory_capacity"], artifacts=s["artifacts"],
            disk_used=s["disk_used"], disk_capacity=s["disk_capacity"],
        )

    async def _register(self, deadline: float) -> None:
        while True:
            try:
                frame = await self.gs.call(RegisterWorker(worker=self.info()), CallContext(deadline=time.time() + 5))
                assert isinstance(frame.message, Registered)
                self.incarnation = frame.message.incarnation
                await self._announce_replicas()
                return
            except TensorCastError as exc:
                if time.time() > deadline:
                    raise Unavailable(f"cannot register with the global store: {exc}") from exc
                await asyncio.sleep(0.2)

    async def _restore_external(self) -> None:
        """Checkpoints registered in place before a restart: re-open them (unchanged files only)."""
        for aid, path, verify in self.store.external_registrations():
            if aid in self.store.external:
                continue
            try:
                ckpt = await asyncio.to_thread(open_checkpoint, path)
            except TensorCastError as exc:
                log.warning("checkpoint %s registered as %s is no longer usable: %s", path, aid, exc)
                continue
            metas = _checkpoint_metas(ckpt)
            if artifact_id(metas) == aid:
                self.store.add_external(aid, metas, dict(ckpt.tensors), verify, ckpt.path)

    async def _announce_replicas(self) -> None:
        """Tell the GS which replicas this worker holds (disk replicas survive restarts)."""
        await self._restore_external()
        ids = set(self.store.memory.replica_ids())
        if self.store.disk is not None:
            ids |= set(self.store.disk.manifests)
        for aid in ids:
            tiers = self.store.tiers(aid)
            ctx = CallContext(deadline=time.time() + 5)
            try:
                await self.gs.call(AddReplica(artifact_id=aid, worker_id=self.worker_id, tiers=tiers), ctx)
            except NotFound:
                tensors = self.store.tensors(aid)
                policy = self.store.disk.manifests[aid].policy if "disk" in tiers and self.store.disk else "cache"
                info = ArtifactInfo(id=aid, tensors=tensors, nbytes=_nbytes(tensors), policy=policy)
                await self.gs.call(CommitArtifact(artifact=info, worker_id=self.worker_id, tiers=tiers), ctx)
        if ids:
            log.info("announced %d replicas to the global store", len(ids))

    async def _heartbeat_loop(self) -> None:
        interval = self.config.worker.heartbeat_interval
        while True:
            await asyncio.sleep(interval)
            dropped = tuple(self._dropped)
            stats = self.store.stats()
            now, b_in, b_out = time.time(), self.bytes_in, self.data_server.bytes_sent
            t0, in0, out0 = self._net_mark
            self._net_mark = (now, b_in, b_out)
            elapsed = max(now - t0, 1e-3)
            try:
                frame = await self.gs.call(
                    Heartbeat(worker_id=self.worker_id, incarnation=self.incarnation, dropped=dropped,
                              net_in_bps=(b_in - in0) / elapsed, net_out_bps=(b_out - out0) / elapsed,
                              transfers_in_flight=self.fetcher.in_flight + self.data_server.active, **stats),
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

    async def _housekeeping_loop(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            try:
                self.puts.reap(time.time())
                await self.store.housekeeping()
                loop = asyncio.get_running_loop()
                if not self._busy():
                    await loop.run_in_executor(self._background, self.store.memory.trim)
                last_work = max(self._last_busy, self.store.memory.last_alloc)
                if not self._busy() and time.monotonic() - last_work >= self.config.worker.prefault_idle_seconds:
                    await loop.run_in_executor(self._background, self.store.memory.stock.refill, self._busy)
            except Exception:
                log.exception("housekeeping failed")

    def _busy(self) -> bool:
        """A put, fetch or send is running: pre-faulting must not compete with it for the CPU."""
        busy = bool(self.puts.pending or self.fetcher.in_flight or self.data_server.active)
        if busy:
            self._last_busy = time.monotonic()
        return busy

    async def _replica_gone(self, artifact_id: str, tier: str) -> None:
        if tier == "memory":
            self.devices.remove(artifact_id)
        with contextlib.suppress(TensorCastError):
            await self.gs.call(RemoveReplica(artifact_id=artifact_id, worker_id=self.worker_id, tier=tier),
                               CallContext(deadline=time.time() + 5))

    # ----------------------------------------------------------------- routing
    async def _peer(self, worker_id: str, ctx: CallContext) -> RpcChannel:
        address = self._peer_addresses.get(worker_id)
        if address is None:
            frame = await self.gs.call(ListWorkers(), ctx)
            assert isinstance(frame.message, WorkerList)
            self._peer_addresses = {w.worker_id: w.address for w in frame.message.workers}
            address = self._peer_addresses.get(worker_id)
            if address is None:
                raise NotFound(f"no worker {worker_id!r}")
        ch = self._peers.get(address)
        if ch is None:
            ch = RpcChannel(address, self.config.wire, token=self.config.token, peer_id=self.worker_id,
                            host_id=self.host_id)
            self._peers[address] = ch
        return ch

    async def _route(self, worker_id: str, msg: Any, req: Request) -> Any | None:
        """Forward ``msg`` to ``worker_id`` unless that is this worker (then None: handle it here)."""
        if worker_id in ("", self.worker_id):
            return None
        ch = await self._peer(worker_id, req.ctx)
        return (await ch.call(msg, req.ctx)).message

    # ----------------------------------------------------------------- gateway port (plans)
    async def route(self, worker_id: str, msg: Any, ctx: CallContext) -> Any:
        """Run ``msg`` on ``worker_id`` (this worker included) and return its reply."""
        if worker_id == self.worker_id:
            handler = self.registry.get(type(msg))
            assert handler is not None
            return await handler[0](msg, Request(conn=None, ctx=ctx, payload=None, peer=None))
        ch = await self._peer(worker_id, ctx)
        return (await ch.call(msg, ctx)).message

    async def gs_call(self, msg: Any, ctx: CallContext) -> Any:
        if isinstance(msg, DeleteArtifact | ReleaseLease):
            return await self.delete(msg, Request(conn=None, ctx=ctx, payload=None, peer=None))
        return (await self.gs.call(msg, ctx)).message

    async def instance_call(self, instance_id: str, msg: InstanceCall, ctx: CallContext) -> InstanceReply:
        frame = await self.gs.call(ListInstances(), ctx)
        assert isinstance(frame.message, InstanceList)
        info = next((i for i in frame.message.instances if i.instance_id == instance_id), None)
        if info is None:
            raise NotFound(f"no instance {instance_id!r}")
        if not info.alive:
            raise Unavailable(f"instance {instance_id!r} is not alive (no heartbeat)")
        ch = self._instances.get(info.address)
        if ch is None:
            ch = RpcChannel(info.address, self.config.wire, token=self.config.token, peer_id=self.worker_id,
                            host_id=self.host_id)
            self._instances[info.address] = ch
        reply = (await ch.call(msg, ctx)).message
        assert isinstance(reply, InstanceReply)
        return reply

    async def worker_ids(self, ctx: CallContext) -> set[str]:
        frame = await self.gs.call(ListWorkers(), ctx)
        assert isinstance(frame.message, WorkerList)
        return {w.worker_id for w in frame.message.workers}

    async def instance_ids(self, ctx: CallContext) -> set[str]:
        frame = await self.gs.call(ListInstances(), ctx)
        assert isinstance(frame.message, InstanceList)
        return {i.instance_id for i in frame.message.instances}

    async def run_plan(self, msg: RunPlan, req: Request) -> PlanResult:
        return await self.plans.run(msg, req.ctx)

    async def call_instance(self, msg: InstanceCall, req: Request) -> InstanceReply:
        return await self.instance_call(msg.instance_id, msg, req.ctx)

    # ----------------------------------------------------------------- put
    async def put_begin(self, msg: PutBegin, req: Request) -> PutPlan:
        placement = resolve_placement(msg.placement, self.config.worker.cold_memory_ttl)
        return await self.puts.begin(msg, placement)

    async def put_data(self, msg: PutData, req: Request) -> Ack:
        assert isinstance(req.payload, memoryview)
        self.puts.data_received(msg, req.payload.nbytes)
        self.bytes_in += req.payload.nbytes
        return Ack()

    async def put_commit(self, msg: PutCommit, req: Request) -> PutDone:
        put = await self.puts.commit(msg.put_id)
        self._dropped.discard(put.artifact_id)
        info = ArtifactInfo(id=put.artifact_id, tensors=put.tensors, nbytes=_nbytes(put.tensors),
                            policy=put.placement.name)
        frame = await self.gs.call(CommitArtifact(artifact=info, worker_id=self.worker_id, key=put.key, ttl=put.ttl,
                                                  tiers=self.store.tiers(put.artifact_id)), req.ctx)
        done = frame.message
        assert isinstance(done, ArtifactInfo)
        if put.placement.replicas > 1:
            done = await self._replicate(done, put.placement.replicas - 1, req)
        log.info("stored artifact %s (%d bytes, %s, tiers %s)%s", put.artifact_id, info.nbytes, put.placement.name,
                 ",".join(self.store.tiers(put.artifact_id)), f" key={put.key}" if put.key else "")
        return PutDone(artifact=done)

    async def _replicate(self, info: ArtifactInfo, extra: int, req: Request) -> ArtifactInfo:
        """Copy a fresh artifact to ``extra`` other live workers (other hosts first), worker-to-worker."""
        frame = await self.gs.call(ListWorkers(), req.ctx)
        assert isinstance(frame.message, WorkerList)
        others = sorted((w for w in frame.message.workers if w.alive and w.worker_id != self.worker_id),
                        key=lambda w: (w.host_id == self.host_id, w.memory_used / max(w.memory_capacity, 1)))
        for w in others[:extra]:
            try:
                await self._route(w.worker_id, Prefetch(artifact_id=info.id, worker_id=w.worker_id), req)
            except TensorCastError as exc:
                log.warning("extra replica of %s on %s failed: %s", info.id, w.worker_id, exc)
        got = (await self.gs.call(GetArtifact(key_or_id=info.id), req.ctx)).message
        assert isinstance(got, ArtifactInfo)
        return got

    async def put_abort(self, msg: PutAbort, req: Request) -> Ack:
        put = self.puts.pending.get(msg.put_id)
        if put is not None:
            self.puts.abandon(put)
        return Ack()

    # ----------------------------------------------------------------- replicas
    async def map_tensors(self, msg: MapTensors, req: Request) -> Mapped:
        names = msg.names or tuple(t.name for t in self.store.tensors(msg.artifact_id))
        refs = tuple(self.store.segment_refs(msg.artifact_id, names, msg.tier))
        if msg.device and self.devices.has(msg.artifact_id, msg.device):
            on_device = self.devices.get(msg.artifact_id, msg.device)
            if all(n in on_device for n in names):
                return Mapped(segments=refs, cuda_ipc=tuple(export_handle(on_device[n]) for n in names))
        return Mapped(segments=refs)

    async def prefetch(self, msg: Prefetch, req: Request) -> Prefetched:
        routed = await self._route(msg.worker_id, msg, req)
        if routed is not None:
            return routed  # type: ignore[no-any-return]
        device = check_device(msg.device) if msg.device else ""  # refused before any work
        info = (await self.gs.call(GetArtifact(key_or_id=msg.artifact_id), req.ctx)).message
        assert isinstance(info, ArtifactInfo)
        if msg.view is not None:
            done = await self._materialize_view(info, msg, req)
            if device:
                await self._copy_to_device(msg.view_id, device)
            return done
        result = await self.fetcher.fetch(info, req.ctx.deadline, req.ctx.trace_id, msg.streams)
        if device:
            await self._copy_to_device(info.id, device)
        if msg.pin:
            self.store.pin(info.id, msg.pin_ttl)
        self.bytes_in += result.bytes_moved
        if not result.already_present:
            await self.gs.call(AddReplica(artifact_id=info.id, worker_id=self.worker_id, tiers=("memory",)), req.ctx)
            log.info("prefetched %s from %s (%d bytes, %.3fs, %d retries)", info.id, result.source or "local disk",
                     result.bytes_moved, result.seconds, result.retries)
        return result

    async def _copy_to_device(self, artifact_id: str, device: str) -> None:
        """Copy a memory replica to ``device`` (pipelined H2D), kept for CUDA IPC hand-offs."""
        if self.devices.has(artifact_id, device):
            return
        metas = self.store.memory.tensors(artifact_id)
        nbytes = sum(t.nbytes for t in metas)
        self.devices.reserve(nbytes)
        releases = []
        try:
            host = {}
            for t in metas:
                src, _tier, release = self.store.lease_tensor(artifact_id, t, "memory")
                releases.append(release)
                host[t.name] = wrap_bytes(src, t, "numpy")
            tensors = await asyncio.to_thread(to_device, host, device)
        except BaseException:
            self.devices.unreserve(nbytes)
            raise
        finally:
            for release in releases:
                release()
        self.devices.add(artifact_id, device, tensors, nbytes)
        log.info("copied %s to %s (%d bytes)", artifact_id, device, nbytes)

    async def _materialize_view(self, info: ArtifactInfo, msg: Prefetch, req: Request) -> Prefetched:
        assert msg.view is not None
        if not ARTIFACT_ID_RE.match(msg.view_id):
            raise InvalidArgument(f"view_id {msg.view_id!r} is not an artifact id")
        result, tensors = await self.fetcher.materialize_view(info, msg.view, msg.view_id, req.ctx.deadline,
                                                               req.ctx.trace_id)
        if msg.pin:
            self.store.pin(msg.view_id, msg.pin_ttl)
        self.bytes_in += result.bytes_moved
        if not result.already_present:
            view_info = ArtifactInfo(id=msg.view_id, tensors=tensors, nbytes=_nbytes(tensors), policy="cache",
                                     meta={**msg.view_meta, "view_of": info.id})
            await self.gs.call(CommitArtifact(artifact=view_info, worker_id=self.worker_id, tiers=("memory",)),
                               req.ctx)
            log.info("materialized view %s of %s (%d bytes, %.3fs)", msg.view_id, info.id, result.bytes_moved,
                     result.seconds)
        return result

    async def register_checkpoint(self, msg: RegisterCheckpoint, req: Request) -> ArtifactInfo:
        ckpt = await asyncio.to_thread(open_checkpoint, msg.path)
        metas = _checkpoint_metas(ckpt)
        aid = artifact_id(metas)
        self.store.add_external(aid, metas, dict(ckpt.tensors), msg.verify_checksums, ckpt.path)
        meta = {"source": ckpt.path, "format": "safetensors", "model_type": ckpt.model_type,
                "config": json.dumps(ckpt.config)}
        info = ArtifactInfo(id=aid, tensors=metas, nbytes=_nbytes(metas), policy="durable", meta=meta)
        frame = await self.gs.call(CommitArtifact(artifact=info, worker_id=self.worker_id, key=msg.key,
                                                  tiers=("disk",)), req.ctx)
        log.info("registered checkpoint %s as %s (%d tensors, %d bytes, not read)", ckpt.path, aid, len(metas),
                 info.nbytes)
        done = frame.message
        assert isinstance(done, ArtifactInfo)
        return done

    async def unpin(self, msg: Unpin, req: Request) -> Ack:
        routed = await self._route(msg.worker_id, msg, req)
        if routed is not None:
            return routed  # type: ignore[no-any-return]
        self.store.unpin(msg.artifact_id)
        return Ack()

    async def evict(self, msg: Evict, req: Request) -> Ack:
        routed = await self._route(msg.worker_id, msg, req)
        if routed is not None:
            return routed  # type: ignore[no-any-return]
        self.store.unpin(msg.artifact_id)
        await self.store.evict(msg.artifact_id)
        return Ack()

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
        self.devices.remove(aid)
        self.store.drop(aid)
        self._dropped.add(aid)


def _idle_priority() -> None:
    """Run the calling thread only on CPU time nobody else wants (SCHED_IDLE; nice 19 where refused)."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, tid, 19)


def _checkpoint_metas(ckpt: Checkpoint) -> tuple[TensorMeta, ...]:
    return tuple(sorted((TensorMeta(name=t.name, dtype=t.dtype, shape=t.shape, nbytes=t.nbytes,
                                    digest=_location_digest(t)) for t in ckpt.tensors.values()),
                        key=lambda m: m.name))


def _location_digest(t: CheckpointTensor) -> str:
    """Identity of a tensor inside a checkpoint file registered in place: where it is, not its content
    (reading every byte to hash it is what from_disk avoids). Re-registering unchanged files is a no-op."""
    return str(blake3.blake3(f"file:{t.file}:{t.file_size}:{t.file_mtime_ns}:{t.offset}:{t.nbytes}".encode())
               .hexdigest())


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
                                       "host_id": worker.host_id, "roles": list(worker.roles),
                                       "data_address": worker.data_server.address}))
            tmp.replace(ready_file)
        await (stop.wait() if stop is not None else asyncio.Event().wait())
    finally:
        await worker.stop()

