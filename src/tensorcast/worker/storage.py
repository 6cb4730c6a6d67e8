"""The storage role (every worker has it): the worker's pool, its put protocol and its data server.

Owns: the local store (memory and disk tiers), the put handlers (``PutBegin``/``PutData``/``PutCommit``/
``PutAbort``, recording the artifact at the global store, extra copies for placements that want them and
their repair after a worker's loss, with ``worker.replication``; a copy whose record failed is settled by
``worker.unrecorded``),
same-host mappings (``MapTensors``), pins, evictions and drops, the data server that serves this
worker's bytes over the configured transport, re-announcing replicas after a (re)registration, the usage
figures heartbeats carry, and housekeeping (abandoned puts, cold TTLs, watermarks, pre-faulted stock, checking
unchecked blobs while idle). Bytes are handed out (mapped, sent) only once checked (``worker.trust``).
Requests naming another worker (``Unpin``/``Evict`` with its id) are routed there. The other roles see it
through ``worker.roles.StoragePort`` only. Does not own: pulling replicas in (``worker.loading``, with this
role's ``Fetcher``), the put protocol's decisions (``worker.puts``, ``pool.placement``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec

from tensorcast import clock
from tensorcast.context import CallContext
from tensorcast.errors import InvalidArgument, NotFound, TensorCastError
from tensorcast.obs import metrics
from tensorcast.pool.device import DeviceTier
from tensorcast.pool.placement import PRESETS, resolve_placement
from tensorcast.records import ArtifactInfo, SliceSpec, TensorMeta, WorkerInfo, WorkerLoad
from tensorcast.transport.base import SourceLease, Transport
from tensorcast.transport.cuda_ipc import export_handle
from tensorcast.transport.registry import make_transport
from tensorcast.wire.messages import (
    MAX_REPORTED_READS,
    Ack,
    DataRequest,
    DropArtifact,
    Evict,
    Mapped,
    MapTensors,
    Prefetched,
    PutAbort,
    PutBegin,
    PutCommit,
    PutData,
    PutDone,
    PutPlan,
    ReportReads,
    Unpin,
)
from tensorcast.wire.rpc import HandlerRegistry, Request
from tensorcast.worker.fetch import Fetcher
from tensorcast.worker.puts import PutManager
from tensorcast.worker.replication import Replicator
from tensorcast.worker.roles import WorkerParts
from tensorcast.worker.store import LocalStore
from tensorcast.worker.trust import BlobTrust
from tensorcast.worker.unrecorded import UnrecordedCopies

__all__ = ["StorageRole", "nbytes_of"]

log = logging.getLogger("tensorcast.worker")
# Seconds without a request before background work may run (the worker is not serving anyone).
_QUIET = 0.25


def nbytes_of(tensors: tuple[TensorMeta, ...]) -> int:
    return sum(t.nbytes for t in tensors)


class StorageRole:
    def __init__(self, parts: WorkerParts, transport: Transport | None = None) -> None:
        """``transport``: the data plane (default: the configured one, ``transport.kind``)."""
        self.parts = parts
        config = parts.config
        self.worker_id = parts.worker_id
        self.store = LocalStore(config.worker, parts.worker_id, self._replica_gone)
        self.trust = BlobTrust(self.store)
        self.puts = PutManager(config.worker, self.store, self.trust)
        self.unrecorded = UnrecordedCopies(self.store, self.puts, parts.gs, self.drop)
        self.devices = DeviceTier(config.worker.device_capacity)
        self.transport = transport or make_transport(
            config.transport.kind, config.wire, token=config.token, max_streams=config.transport.max_streams * 2,
            limits=config.transport, tls=config.tls)
        self.data_server = self.transport.serve(self.serve_source, corrupt_chunks=config.worker.fault_corrupt_chunks)
        self.replicator = Replicator(parts)
        self.fetcher = Fetcher(parts.worker_id, self.store, self.trust, self.transport, config.transport,
                               parts.host_id)
        self.bytes_in = 0  # payload and fetched bytes received, for the network-pressure signal
        # Bytes by (transport, direction) for metrics: "rpc" carries put payloads from remote callers, "shm" the
        # bytes same-host callers wrote or mapped, the data-plane transport (tcp) fetches between workers.
        self.moved: collections.Counter[tuple[str, str]] = collections.Counter()
        self._net_mark = (clock.time(), 0, 0)
        self._last_busy = 0.0  # monotonic time a put, fetch or send was last seen running
        self._tasks: list[asyncio.Task[None]] = []
        # Pre-faulting the stock and giving back pack tails: one low-priority thread, so that it never
        # slows the engine that just loaded its weights (a 2-core host has no CPU to spare).
        self._background = ThreadPoolExecutor(1, thread_name_prefix="tensorcast-prefault",
                                              initializer=_low_priority)

    def register(self, registry: HandlerRegistry) -> None:
        registry.register(PutBegin, self.put_begin, sink=lambda msg, conn: self.puts.inline_sink(msg))
        registry.register(PutData, self.put_data, sink=lambda msg, conn: self.puts.data_sink(msg))
        registry.register(PutCommit, self.put_commit)
        registry.register(PutAbort, self.put_abort)
        registry.register(MapTensors, self.map_tensors)
        registry.register(ReportReads, self.report_reads)
        registry.register(Unpin, self.unpin)
        registry.register(Evict, self.evict)
        registry.register(DropArtifact, self.drop_artifact)

    async def start(self) -> None:
        self.trust.start(asyncio.get_running_loop())
        self._tasks.append(asyncio.ensure_future(self._housekeeping_loop()))
        self._tasks.append(asyncio.ensure_future(self.replicator.repair_loop()))

    def start_data_server(self) -> str:
        return self.data_server.start(self.parts.config.worker.host, 0)

    def halt(self) -> None:
        """Stop at once (a kill -9): the data server closed, background work abandoned, pending puts left."""
        for t in self._tasks:
            t.cancel()
        self.data_server.close()
        self._background.shutdown(wait=False)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await self.replicator.stop()
        self.data_server.close()
        self.transport.close()
        for put in list(self.puts.pending.values()):
            self.puts.abandon(put)
        self.store.close()  # a refill in progress stops after its current segment
        self._background.shutdown(wait=True)

    # ----------------------------------------------------------------- registration and heartbeats
    def info(self, address: str) -> WorkerInfo:
        p = self.parts
        return WorkerInfo(
            worker_id=p.worker_id, address=address, host_id=p.host_id, roles=p.roles, pid=os.getpid(),
            incarnation=p.gs.incarnation, data_address=self.data_server.address,
            **msgspec.structs.asdict(self.store.stats()))

    @property
    def data_address(self) -> str:
        return self.data_server.address

    async def fetch(self, info: ArtifactInfo, deadline: float | None, trace_id: str, streams: int = 0) -> Prefetched:
        return await self.fetcher.fetch(info, deadline, trace_id, streams)

    async def materialize_view(self, info: ArtifactInfo, view: dict[str, tuple[SliceSpec, ...]], view_id: str,
                               deadline: float | None, trace_id: str) -> tuple[Prefetched, tuple[TensorMeta, ...]]:
        return await self.fetcher.materialize_view(info, view, view_id, deadline, trace_id)

    def transfers_in_flight(self) -> int:
        """Data-plane transfers running now: fetches into this worker and sends out of it."""
        return self.fetcher.in_flight + self.data_server.active

    def fetched(self, kind: str, result: Prefetched) -> None:
        """Account for a prefetch (``kind`` fetch) or view materialization done by this worker."""
        self.bytes_in += result.bytes_moved
        # A copy from this worker's own disk tier has no source worker: it crossed no network.
        self.moved["disk" if not result.source else self.parts.config.transport.kind, "received"] += \
            result.bytes_moved
        metrics.operation("transfer", kind, result.bytes_moved, result.seconds)

    def heartbeat_load(self, plans_in_flight: int = 0) -> WorkerLoad:
        now, b_in, b_out = clock.time(), self.bytes_in, self.data_server.bytes_sent
        t0, in0, out0 = self._net_mark
        self._net_mark = (now, b_in, b_out)
        elapsed = max(now - t0, 1e-3)
        return msgspec.structs.replace(self.store.stats(), net_in_bps=(b_in - in0) / elapsed,
                                       net_out_bps=(b_out - out0) / elapsed, plans_in_flight=plans_in_flight,
                                       transfers_in_flight=self.transfers_in_flight())

    async def announce(self) -> None:
        """Tell the global store which replicas this worker holds (disk replicas survive restarts). A copy
        of an artifact deleted (or whose lease expired) while this worker was away is dropped here, never
        brought back; an artifact the store has no trace of (its database was replaced) is recorded again.
        Copies whose put the store may never have recorded are left to ``worker.unrecorded``."""
        store, gs = self.store, self.parts.gs
        ids = set(store.memory.replica_ids()) | set(store.disk.manifests if store.disk is not None else ())
        ids = {aid for aid in ids if aid not in self.unrecorded}
        dropped = 0
        for aid in ids:
            tiers = store.tiers(aid)
            try:
                await gs.add_replica(aid, tiers, restored=True)
                continue
            except NotFound:
                pass
            tensors = store.tensors(aid)
            policy = store.disk.manifests[aid].policy if "disk" in tiers and store.disk else "cache"
            info = ArtifactInfo(id=aid, tensors=tensors, nbytes=nbytes_of(tensors), policy=policy,
                                replicas_wanted=PRESETS[policy].replicas if policy in PRESETS else 1)
            try:
                await gs.commit_artifact(info, CallContext(deadline=clock.time() + 5), tiers=tiers, restored=True)
            except NotFound as exc:
                log.info("dropping %s, deleted while this worker was away: %s", aid, exc.message)
                self.drop(aid)
                dropped += 1
        if ids:
            log.info("announced %d replicas to the global store (%d dropped)", len(ids) - dropped, dropped)

    # ----------------------------------------------------------------- housekeeping
    async def _housekeeping_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(0.5)
            try:
                self.puts.reap(clock.time())
                await self.store.housekeeping()
                if not self.busy():
                    await loop.run_in_executor(self._background, self.store.memory.trim)
                if not self.busy() and self.parts.config.worker.verify_idle_bytes:
                    bad = await loop.run_in_executor(self._background, self.trust.verify_idle,
                                                     self.parts.config.worker.verify_idle_bytes, self.busy)
                    for blob in bad:
                        await self.trust.condemn(blob, "idle")
                last_work = max(self._last_busy, self.store.memory.last_alloc)
                if not self.busy() and clock.monotonic() - last_work >= self.parts.config.worker.prefault_idle_seconds:
                    await loop.run_in_executor(self._background, self.store.memory.stock.refill, self.busy)
                await self.unrecorded.settle()
            except Exception:
                log.exception("housekeeping failed")

    def busy(self) -> bool:
        """A put, fetch or send is running, or a request came in a moment ago: pre-faulting and trimming must
        not compete with the hot path for the CPU (nor hold the locks it needs)."""
        busy = bool(self.puts.pending or self.fetcher.in_flight or self.data_server.active) or \
            self.parts.activity.quiet_for() < _QUIET
        if busy:
            self._last_busy = clock.monotonic()
        return busy

    async def _replica_gone(self, artifact_id: str, tier: str) -> None:
        if tier == "memory":
            self.devices.remove(artifact_id)
        await self.parts.gs.remove_replica(artifact_id, tier)

    # ----------------------------------------------------------------- put
    async def put_begin(self, msg: PutBegin, req: Request) -> PutPlan:
        placement = resolve_placement(msg.placement, self.parts.config.worker.cold_memory_ttl)
        if not msg.inline:
            return await self.puts.begin(msg, placement)
        if req.payload is not None and not isinstance(req.payload, memoryview):
            raise InvalidArgument("an inline PutBegin carries its bytes as one payload")
        plan = await self.puts.begin_inline(msg, placement, req.payload)  # a small put in one request
        self.moved["rpc", "received"] += req.payload.nbytes if req.payload is not None else 0
        done = await self.put_commit(PutCommit(put_id=plan.put_id), req)
        return msgspec.structs.replace(plan, artifact=done.artifact)

    async def put_data(self, msg: PutData, req: Request) -> Ack:
        if not isinstance(req.payload, memoryview):  # a hostile or broken peer: refused, the worker serves on
            raise InvalidArgument("PutData without its payload (a data frame carries the bytes it writes)")
        self.puts.data_received(msg, req.payload.nbytes)
        self.bytes_in += req.payload.nbytes
        self.moved["rpc", "received"] += req.payload.nbytes
        return Ack()

    async def put_commit(self, msg: PutCommit, req: Request) -> PutDone:
        pending = self.puts.pending.get(msg.put_id)
        try:
            return await self._put_commit(msg, req)
        except TensorCastError as exc:
            path = "shm" if pending is not None and not pending.stream else "network" if pending else "unknown"
            metrics.operation("put", path, 0, 0.0, exc.code)
            raise

    async def _put_commit(self, msg: PutCommit, req: Request) -> PutDone:
        pending = self.puts.pending.get(msg.put_id)
        # What a same-host caller wrote into shared memory (blobs already held were not written); counted
        # now, as committing hands the targets over.
        written = sum(pending.tensors[i].nbytes for i in pending.memory_targets) \
            if pending is not None and not pending.stream else 0
        put = await self.unrecorded.commit_locally(msg.put_id, msg.digests)
        recorded = False
        try:  # a copy stored here that the store did not record is settled later (``worker.unrecorded``)
            self.parts.gs.kept(put.artifact_id)
            tiers = self.store.tiers(put.artifact_id)
            info = ArtifactInfo(id=put.artifact_id, tensors=put.tensors, nbytes=nbytes_of(put.tensors),
                                policy=put.placement.name, replicas_wanted=put.placement.replicas)
            done = await self.parts.gs.commit_artifact(info, req.ctx, key=put.key, ttl=put.ttl, tiers=tiers)
            recorded = True
        finally:
            self.unrecorded.store_commit_ended(put, recorded, req.ctx.deadline)
        if put.placement.replicas > 1:
            done = await self.replicator.place(done, put.placement.replicas, req.ctx)
        log.debug("stored artifact %s (%d bytes, %s, tiers %s)%s", put.artifact_id, info.nbytes, put.placement.name,
                 ",".join(tiers), f" key={put.key}" if put.key else "")
        self.moved["shm", "received"] += written
        metrics.operation("put", "network" if put.stream else "shm", info.nbytes, clock.monotonic() - put.started)
        return PutDone(artifact=done)

    async def put_abort(self, msg: PutAbort, req: Request) -> Ack:
        put = self.puts.pending.get(msg.put_id)
        if put is not None:
            self.puts.abandon(put)
        return Ack()

    # ----------------------------------------------------------------- replicas
    async def map_tensors(self, msg: MapTensors, req: Request) -> Mapped:
        started = time.perf_counter()
        names = msg.names or tuple(t.name for t in self.store.tensors(msg.artifact_id))
        await self.trust.ensure_read(msg.artifact_id, names, msg.tier)
        refs = tuple(self.store.segment_refs(msg.artifact_id, names, msg.tier))
        nbytes = sum(r.size for r in refs if r is not None)
        self.moved["shm", "sent"] += nbytes
        metrics.operation("get", "map", nbytes, time.perf_counter() - started)
        if msg.device and self.devices.has(msg.artifact_id, msg.device):
            on_device = self.devices.get(msg.artifact_id, msg.device)
            if all(n in on_device for n in names):
                return Mapped(segments=refs, cuda_ipc=tuple(export_handle(on_device[n]) for n in names))
        return Mapped(segments=refs)

    def serve_source(self, req: DataRequest) -> SourceLease:
        """The data server's bytes for ``req`` (on its threads): each range sent in full counts as a get over
        the network, timed from here to its last byte; one the store refuses counts under its error code."""
        started = time.perf_counter()
        try:
            self.trust.check_read(req)
            lease = self.store.open_source(req)
        except TensorCastError as exc:
            metrics.operation("get", "network", 0, 0.0, exc.code)
            raise
        lease.sent = lambda nbytes: metrics.operation("get", "network", nbytes, time.perf_counter() - started)
        return lease

    async def report_reads(self, msg: ReportReads, req: Request) -> Ack:
        """Reads a same-host caller served from places this worker named before: uses and gets all the same."""
        for r in msg.reads[:MAX_REPORTED_READS]:
            if r.reads > 0 and self.store.memory.has_replica(r.artifact_id):
                self.store.touch(r.artifact_id)
                whole = nbytes_of(self.store.memory.tensors(r.artifact_id))
                nbytes = min(max(r.nbytes, 0), r.reads * whole)  # no more than the reads can have mapped
                self.moved["shm", "sent"] += nbytes
                metrics.kept_maps(r.reads, nbytes)
        return Ack()

    async def unpin(self, msg: Unpin, req: Request) -> Ack:
        if msg.worker_id not in ("", self.worker_id):
            return await self.parts.peers.call(msg.worker_id, msg, req.ctx)
        self.store.unpin(msg.artifact_id)
        return Ack()

    async def evict(self, msg: Evict, req: Request) -> Ack:
        if msg.worker_id not in ("", self.worker_id):
            return await self.parts.peers.call(msg.worker_id, msg, req.ctx)
        self.store.unpin(msg.artifact_id)
        await self.store.evict(msg.artifact_id)
        return Ack()

    async def drop_artifact(self, msg: DropArtifact, req: Request) -> Ack:
        self.drop(msg.artifact_id)
        return Ack()

    def drop(self, artifact_id: str) -> None:
        """Forget every local copy of a deleted artifact (acknowledged to the store with the next heartbeat)."""
        self.devices.remove(artifact_id)
        self.store.drop(artifact_id)
        self.parts.gs.dropped(artifact_id)


def _low_priority() -> None:
    """Run the calling thread at the lowest normal priority (nice 19). Not SCHED_IDLE: a thread that only
    runs on idle CPU can be preempted while it holds a kernel lock of this process (populating a mapping
    holds the mmap lock), and then the event loop waits for it as long as the CPUs stay busy."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
