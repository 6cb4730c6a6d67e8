"""The global store service: control-plane metadata over RPC, durable in a ``MetadataBackend``.

Owns: the GS handlers (worker registry and heartbeats, instances, shard leases) composed with the artifact
requests (``gs.artifacts``), the background reaper of ended leases, and the GS process entry point. Tensor
bytes never come here. Every mutation is committed by the backend before the reply is sent. Does not own:
storage (``gs.sqlite``, ``gs.etcd``), the reference rules (``gs.refs``) or placement.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import os
import uuid
from collections.abc import Collection
from pathlib import Path
from typing import Any

import msgspec

from tensorcast import clock
from tensorcast.config import Config
from tensorcast.credentials import WORKER, allows, check_bind
from tensorcast.errors import InvalidArgument, NotFound
from tensorcast.gs.artifacts import ArtifactService
from tensorcast.gs.backend import MetadataBackend
from tensorcast.gs.goals import under_replicated
from tensorcast.gs.observe import GSGauges, gs_routes
from tensorcast.gs.page_index import PageIndex
from tensorcast.gs.read_leases import ReadLeases
from tensorcast.gs.sqlite import SqliteBackend
from tensorcast.kv.leases import LeaseFeed, LeaseRecord, grant, release, renew
from tensorcast.obs import metrics, tracing
from tensorcast.obs.http import HttpServer
from tensorcast.records import ArtifactInfo, InstanceInfo, ShardLease, WorkerInfo
from tensorcast.wire.caller import Caller
from tensorcast.wire.kv_messages import (
    AcquireShards,
    GSStats,
    GSStatsReply,
    ListShards,
    PageIndexGet,
    PageIndexPut,
    PageIndexReply,
    ReleaseShards,
    RenewShards,
    ShardGrants,
    ShardTable,
)
from tensorcast.wire.messages import (
    Ack,
    AddReplica,
    ArtifactList,
    ArtifactReply,
    CommitArtifact,
    CommitArtifacts,
    CommitsDone,
    DeleteArtifact,
    Deleted,
    GetArtifact,
    Heartbeat,
    HeartbeatReply,
    InstanceHeartbeat,
    InstanceList,
    ListArtifacts,
    ListInstances,
    ListUnderReplicated,
    ListWorkers,
    Registered,
    RegisterInstance,
    RegisterWorker,
    ReleaseLease,
    RemoveReplica,
    RenewLease,
    UnderReplicated,
    WorkerList,
)
from tensorcast.wire.rpc import Handler, HandlerRegistry, Request, RpcServer

__all__ = ["GlobalStore", "run_global_store"]

log = logging.getLogger("tensorcast.gs")


class GlobalStore:
    def __init__(self, backend: MetadataBackend, config: Config, caller: Caller | None = None) -> None:
        """``caller``: how this store reaches workers (to revoke read leases; without one it grants none)."""
        self.backend = backend
        self.config = config
        self.reads = ReadLeases(backend, config.gs.read_lease_seconds, caller, self._workers)
        self.artifacts = ArtifactService(backend, config, self._workers, self.reads)
        self.page_index = PageIndex(backend, config.gs)
        # Requests served, by message type: lets tests prove which paths touch the GS.
        self.request_counts: collections.Counter[str] = collections.Counter()
        self._pruned = 0.0  # when tombstones were last pruned
        self._feed = LeaseFeed(uuid.uuid4().hex[:12])  # numbers lease changes for ListShards deltas
        self.metrics_url = ""  # where this process serves metrics and the dashboard, once it does
        self.registry = HandlerRegistry()
        for msg_type, handler in (
            (RegisterWorker, self.register_worker),
            (Heartbeat, self.heartbeat),
            (ListWorkers, self.list_workers),
            (CommitArtifact, self.commit_artifact),
            (CommitArtifacts, self.commit_artifacts),
            (GetArtifact, self.get_artifact),
            (ListArtifacts, self.list_artifacts),
            (DeleteArtifact, self.delete_artifact),
            (RenewLease, self.renew_lease),
            (ReleaseLease, self.release_lease),
            (RemoveReplica, self.remove_replica),
            (AddReplica, self.add_replica),
            (RegisterInstance, self.register_instance),
            (ListShards, self.list_shards),
            (AcquireShards, self.acquire_shards),
            (RenewShards, self.renew_shards),
            (ReleaseShards, self.release_shards),
            (GSStats, self.stats),
            (PageIndexPut, self.page_index_put),
            (PageIndexGet, self.page_index_get),
            (InstanceHeartbeat, self.instance_heartbeat),
            (ListInstances, self.list_instances),
            (ListUnderReplicated, self.list_under_replicated),
        ):
            self.registry.register(msg_type, self._counted(msg_type.__name__, handler))

    def _counted(self, name: str, handler: Handler) -> Handler:
        async def run(msg: Any, req: Request) -> Any:
            self.request_counts[name] += 1
            return await handler(msg, req)

        return run

    # ----------------------------------------------------------------- helpers
    def _alive(self, w: WorkerInfo, now: float) -> bool:
        return now - w.last_heartbeat < self.config.gs.worker_liveness_timeout

    async def _workers(self, only: Collection[str] | None = None) -> dict[str, WorkerInfo]:
        """Every worker, alive or not as of now; or only those in ``only`` (the holders of one artifact's
        replicas: a row each, where a whole table would be read for every commit and read of one artifact)."""
        now = clock.time()
        found = await self.backend.list_workers() if only is None else \
            [w for w in [await self.backend.get_worker(wid) for wid in only] if w is not None]
        return {w.worker_id: msgspec.structs.replace(w, alive=self._alive(w, now)) for w in found}

    async def reap(self, artifact_id: str, reason: str) -> None:
        await self.artifacts.reap(artifact_id, reason)

    # ----------------------------------------------------------------- handlers
    async def register_worker(self, msg: RegisterWorker, req: Request) -> Registered:
        incarnation, orphans = await self.backend.register_worker(msg.worker, clock.time())
        log.info("worker %s registered at %s (incarnation %d)", msg.worker.worker_id, msg.worker.address,
                 incarnation)
        for aid in orphans:  # their only copies were in the memory of this worker's previous incarnation
            await self.reap(aid, f"lost: its only copy was in the memory of worker {msg.worker.worker_id}, "
                                 "which restarted")
        return Registered(incarnation=incarnation)

    async def heartbeat(self, msg: Heartbeat, req: Request) -> HeartbeatReply:
        known, drop = await self.backend.heartbeat(msg.worker_id, msg.incarnation, msg.load, clock.time(),
                                                   msg.dropped)
        return HeartbeatReply(drop=drop, reregister=not known)

    async def list_workers(self, msg: ListWorkers, req: Request) -> WorkerList:
        return WorkerList(workers=tuple((await self._workers()).values()))

    async def commit_artifact(self, msg: CommitArtifact, req: Request) -> ArtifactReply:
        return await self.artifacts.commit(msg)

    async def commit_artifacts(self, msg: CommitArtifacts, req: Request) -> CommitsDone:
        return await self.artifacts.commit_group(msg)

    async def get_artifact(self, msg: GetArtifact, req: Request) -> ArtifactReply:
        reply = await self.artifacts.get(msg)
        if msg.read_lease and req.peer is not None and req.conn is not None and allows(req.conn.role, WORKER):
            granted = await self.reads.grant(reply.artifact, req.peer.peer_id)
            reply = msgspec.structs.replace(reply, read_lease_seconds=granted)
        return reply

    async def list_artifacts(self, msg: ListArtifacts, req: Request) -> ArtifactList:
        return await self.artifacts.list(msg, await self._workers())

    async def delete_artifact(self, msg: DeleteArtifact, req: Request) -> Deleted:
        return await self.artifacts.delete(msg)

    async def renew_lease(self, msg: RenewLease, req: Request) -> ArtifactReply:
        return await self.artifacts.renew(msg)

    async def release_lease(self, msg: ReleaseLease, req: Request) -> Deleted:
        return await self.artifacts.release(msg)

    async def register_instance(self, msg: RegisterInstance, req: Request) -> Ack:
        await self.backend.upsert_instance(msg.instance, clock.time())
        log.info("instance %s registered at %s (home %s)", msg.instance.instance_id, msg.instance.address,
                 msg.instance.home_worker)
        return Ack()

    async def instance_heartbeat(self, msg: InstanceHeartbeat, req: Request) -> Ack:
        load = {"running": msg.running, "waiting": msg.waiting, "kv_tokens_used": msg.kv_tokens_used,
                "kv_tokens_capacity": msg.kv_tokens_capacity}
        if not await self.backend.instance_heartbeat(msg.instance_id, load, clock.time()):
            raise NotFound(f"no instance {msg.instance_id}: register again")
        return Ack()

    async def list_instances(self, msg: ListInstances, req: Request) -> InstanceList:
        return InstanceList(instances=tuple(await self.instances()))

    async def instances(self) -> list[InstanceInfo]:
        """Every instance, with ``alive`` as of now."""
        now = clock.time()
        timeout = self.config.gs.worker_liveness_timeout
        return [msgspec.structs.replace(i, alive=now - i.last_heartbeat < timeout)
                for i in await self.backend.list_instances()]

    async def workers(self) -> list[WorkerInfo]:
        """Every worker, with ``alive`` as of now."""
        return list((await self._workers()).values())

    async def info(self, artifact_id: str, workers: dict[str, WorkerInfo] | None = None) -> ArtifactInfo:
        """An artifact's record with its replicas (``NotFound`` when it is gone)."""
        return await self.artifacts.info(artifact_id, workers if workers is not None else await self._workers())

    async def list_under_replicated(self, msg: ListUnderReplicated, req: Request) -> UnderReplicated:
        limit = max(0, min(msg.limit, self.config.gs.list_page_size))
        short, missing = await under_replicated(self, msg.holder, limit)
        return UnderReplicated(artifacts=tuple(short), missing=missing)

    # ----------------------------------------------------------------- shard leases (touched per shard)
    async def _leases(self) -> dict[int, LeaseRecord]:
        return await self.backend.load_leases()

    def _ttl(self, ttl: float) -> float:
        if not (math.isfinite(ttl) and 0 < ttl <= self.config.gs.kv_max_lease_ttl):
            raise InvalidArgument(f"lease ttl must be in (0, {self.config.gs.kv_max_lease_ttl}], got {ttl}")
        return ttl

    def _check_shards(self, shards: tuple[int, ...], tokens: tuple[int, ...] | None = None) -> None:
        if tokens is not None and len(tokens) != len(shards):
            raise InvalidArgument(f"{len(shards)} shards but {len(tokens)} fencing tokens")
        n = self.config.gs.kv_num_shards
        bad = [s for s in shards if not 0 <= s < n]
        if bad:
            raise InvalidArgument(f"shards {bad[:5]} outside [0, {n})")

    async def _grants(self, changed: list[LeaseRecord]) -> ShardGrants:
        """The grants, once durable (``update_leases`` wrote them before returning)."""
        workers = await self._workers()
        return ShardGrants(leases=tuple(_lease_msg(r, workers) for r in changed))

    async def list_shards(self, msg: ListShards, req: Request) -> ShardTable:
        return await self.shard_table(msg.since, msg.epoch)

    async def shard_table(self, since: int = 0, epoch: str = "") -> ShardTable:
        """The lease table, or what changed in it since ``since`` of this store's ``epoch``."""
        leases, now = await self._leases(), clock.time()
        self._feed.observe(leases, now)
        full, shards = self._feed.since(epoch, since)
        revision = self._feed.revision  # before the next await: a change observed meanwhile is not skipped
        workers = await self._workers() if shards else {}
        return ShardTable(num_shards=self.config.gs.kv_num_shards, now=now,
                          leases=tuple(_lease_msg(leases[s], workers) for s in shards),
                          revision=revision, epoch=self._feed.epoch, full=full)

    async def acquire_shards(self, msg: AcquireShards, req: Request) -> ShardGrants:
        self._check_shards(msg.shards)
        ttl, now = self._ttl(msg.ttl), clock.time()

        def acquire(s: int, rec: LeaseRecord | None) -> LeaseRecord | None:
            g = grant(rec, s, msg.worker_id, now, ttl)
            if g is not None and (rec is None or rec.token != g.token):
                log.info("shard %d leased to %s (fencing token %d)", g.shard, g.holder, g.token)
            return g

        return await self._grants(await self.backend.update_leases(msg.shards, acquire))

    async def renew_shards(self, msg: RenewShards, req: Request) -> ShardGrants:
        self._check_shards(msg.shards, msg.tokens)
        ttl, now = self._ttl(msg.ttl), clock.time()
        tokens = dict(zip(msg.shards, msg.tokens, strict=True))
        changed = await self.backend.update_leases(
            msg.shards, lambda s, rec: renew(rec, msg.worker_id, tokens[s], now, ttl))
        return await self._grants(changed)

    async def release_shards(self, msg: ReleaseShards, req: Request) -> ShardGrants:
        self._check_shards(msg.shards, msg.tokens)
        tokens = dict(zip(msg.shards, msg.tokens, strict=True))
        changed = await self.backend.update_leases(msg.shards, lambda s, rec: release(rec, msg.worker_id, tokens[s]))
        return await self._grants(changed)

    async def stats(self, msg: GSStats, req: Request) -> GSStatsReply:
        return GSStatsReply(requests=dict(self.request_counts), metrics_url=self.metrics_url,
                            stores=await self.backend.list_stores(clock.time()))

    async def announce_loop(self, address: str) -> None:
        """Tell the backend this process is alive, a few times per liveness timeout (other global stores,
        clients and dashboards list the live ones)."""
        ttl = self.config.gs.worker_liveness_timeout
        while True:
            try:
                await self.backend.announce_store(address, self.metrics_url, ttl)
            except Exception as exc:
                log.warning("announcing this global store failed: %s", exc)
            await asyncio.sleep(ttl / 3)

    async def page_index_put(self, msg: PageIndexPut, req: Request) -> Ack:
        await self.page_index.put(msg.keys, msg.worker_id)
        return Ack()

    async def page_index_get(self, msg: PageIndexGet, req: Request) -> PageIndexReply:
        return PageIndexReply(holders=tuple(await self.page_index.get(msg.keys)))

    async def add_replica(self, msg: AddReplica, req: Request) -> Ack:
        if not await self.backend.add_replica(msg.artifact_id, msg.worker_id, msg.tiers, msg.restored):
            raise await self.artifacts.gone(msg.artifact_id, f"no artifact {msg.artifact_id}")
        return Ack()

    async def remove_replica(self, msg: RemoveReplica, req: Request) -> Ack:
        if await self.backend.remove_replica(msg.artifact_id, msg.worker_id, msg.tier):
            await self.reap(msg.artifact_id, f"evicted: its last copy was dropped from the {msg.tier} of worker "
                                             f"{msg.worker_id} (a cache miss: put it again)")
        return Ack()

    # ----------------------------------------------------------------- background
    async def reap_leases(self) -> None:
        """Remove the references whose lease ended, and the artifacts left with none (holders drop them at
        their next heartbeat)."""
        while True:
            await asyncio.sleep(self.config.gs.lease_reap_interval)
            try:
                now = clock.time()
                await self.artifacts.reap_expired(now)
                if now - self._pruned > 60.0:
                    self._pruned = now
                    await self.backend.prune_tombstones(now - self.config.gs.tombstone_ttl)
            except Exception:
                log.exception("lease reaper failed")


def _lease_msg(r: LeaseRecord, workers: dict[str, WorkerInfo]) -> ShardLease:
    w = workers.get(r.holder)
    return ShardLease(shard=r.shard, holder=r.holder, token=r.token, expiry=r.expiry, acquired_at=r.acquired_at,
                      address=w.address if w else "", host_id=w.host_id if w else "")


async def run_global_store(config: Config, data_dir: Path, ready_file: Path | None = None,
                           stop: asyncio.Event | None = None) -> None:
    """Serve the GS until ``stop`` is set (or forever). Writes ``{address, pid}`` to ``ready_file``. Without a
    token, it listens on loopback only (its RPC port and its metrics endpoint): refused before anything opens."""
    check_bind(config.gs.host, config.token, "the global store")
    if config.metrics.enabled:
        check_bind(config.metrics.host or config.gs.host, config.token, "the metrics endpoint (metrics.host)")
    backend: MetadataBackend
    if config.gs.etcd_endpoints:
        from tensorcast.gs.etcd import EtcdBackend

        backend = EtcdBackend(config.gs.etcd_endpoints, config.gs.etcd_prefix, config.gs.worker_liveness_timeout)
    else:
        backend = SqliteBackend(data_dir / "gs.sqlite3", config.gs.sqlite_synchronous, config.gs.sqlite_max_bytes)
    await backend.open()
    workers = Caller(config.wire, token=config.token, peer_id="gs", host_id="", tls=config.tls)
    gs = GlobalStore(backend, config, workers)
    server = RpcServer(gs.registry, config.wire, token=config.token, server_id="gs", host_id="", roles=("gs",),
                       tls=config.tls)
    address = await server.start(config.gs.host, config.gs.port)
    metrics.set_enabled(config.metrics.enabled)
    tracing.configure(config.tracing, "tensorcast-gs", roots=False)
    http, source = None, None
    if config.metrics.enabled:
        gauges = GSGauges(gs)
        http = HttpServer(config.token, gs_routes(gs), before_scrape=gauges.refresh, tls=config.tls,
                          allowed_hosts=config.metrics.allowed_hosts)
        gs.metrics_url = await http.start(config.metrics.host or config.gs.host, config.metrics.port)
        source = metrics.add_source(gauges.samples)
    reaper = asyncio.ensure_future(gs.reap_leases())
    announcer = asyncio.ensure_future(gs.announce_loop(address))
    log.info("global store serving at %s (data %s, metrics and dashboard %s)", address, data_dir,
             gs.metrics_url or "off")
    if ready_file is not None:
        tmp = ready_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"address": address, "pid": os.getpid(), "metrics_url": gs.metrics_url}))
        tmp.replace(ready_file)
    try:
        await (stop.wait() if stop is not None else asyncio.Event().wait())
    finally:
        reaper.cancel()
        announcer.cancel()
        if http is not None:
            await http.close()
        if source is not None:
            metrics.remove_source(source)
        await server.close()
        await workers.close()
        await backend.close()
