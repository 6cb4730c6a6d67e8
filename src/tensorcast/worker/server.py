"""The worker process shell: composes role services, serves them, registers, heartbeats, stops.

Owns: which services each role brings (``ROLES``, the table below; ``basic`` is always on), the shared parts
(one caller, the global-store link, the peer directory, the handler registry), the RPC server, the
lifecycle (start the data server, register and announce replicas, start the roles and the heartbeat
loop; stop in reverse), the ready file ``tensorcast up`` and ``LocalCluster`` wait for, and holding
``worker.data_dir`` for the life of the process (``worker.datadir``). Does not own: any request handler
(each role registers its own).

Roles and their services (``ROLES``: each role's builder, given the shared parts and the storage role)::

    basic       StorageRole (pool, puts, data server), LoadingRole (prefetch, views, checkpoints),
                InstanceRegistry (engines attached to this worker)
    gateway     GatewayRole (metadata relayed to the global store, deletes, plans)
    shard-home  ShardHome (a share of the KV-page index under leases with fencing tokens)

The other roles see the storage role only through ``worker.roles.StoragePort``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import msgspec

from tensorcast import clock
from tensorcast.config import Config, default_host_id
from tensorcast.credentials import check_bind
from tensorcast.errors import InvalidArgument
from tensorcast.kv.home import ShardHome
from tensorcast.obs import metrics, tracing
from tensorcast.obs.http import HttpServer, Response
from tensorcast.pool.hugepages import advise_if_small_pages
from tensorcast.pool.segments import SHM_DIR
from tensorcast.records import WorkerInfo, WorkerLoad
from tensorcast.wire.caller import Caller
from tensorcast.wire.rpc import HandlerRegistry, RpcServer
from tensorcast.worker.datadir import claim_data_dir
from tensorcast.worker.gateway import GatewayRole
from tensorcast.worker.gauges import worker_samples
from tensorcast.worker.gs_link import GlobalStoreLink
from tensorcast.worker.instances import InstanceRegistry
from tensorcast.worker.loading import LoadingRole
from tensorcast.worker.peers import Peers
from tensorcast.worker.roles import Activity, Role, WorkerParts
from tensorcast.worker.storage import StorageRole

__all__ = ["ROLES", "Worker", "run_worker"]

log = logging.getLogger("tensorcast.worker")


def _basic(parts: WorkerParts, storage: StorageRole) -> list[Role]:
    return [storage, LoadingRole(parts, storage), InstanceRegistry(parts)]


def _gateway(parts: WorkerParts, storage: StorageRole) -> list[Role]:
    return [GatewayRole(parts, storage)]


def _shard_home(parts: WorkerParts, storage: StorageRole) -> list[Role]:
    return [ShardHome(parts.worker_id, parts.config.kv, parts.caller,
                      f"{parts.config.worker.shm_prefix}-{parts.worker_id}")]


# Each role's services, in the order they register and start (stopped in reverse).
ROLES: dict[str, Callable[[WorkerParts, StorageRole], list[Role]]] = {
    "basic": _basic, "gateway": _gateway, "shard-home": _shard_home}
# Services whose requests move or hold bytes: background work (pre-faulting, trimming) waits for quiet.
_MOVES_BYTES = (StorageRole, LoadingRole, ShardHome)
T = TypeVar("T")


def _one(services: list[Role], kind: type[T]) -> T:
    return next(s for s in services if isinstance(s, kind))


# Seconds a starting worker keeps trying to reach the global store.
_REGISTER_TIMEOUT = 30.0


class Worker:
    def __init__(self, config: Config, worker_id: str, gs_address: str) -> None:
        roles = set(config.worker.roles) | {"basic"}
        unknown = roles - ROLES.keys()
        if unknown:
            raise InvalidArgument(f"unknown worker roles {sorted(unknown)}; known: {sorted(ROLES)}")
        host_id = config.worker.host_id or default_host_id()
        # Several global stores (on one etcd) are equivalent: the caller moves to the next when one is unreachable.
        stores = [a.strip() for a in gs_address.split(",") if a.strip()]
        caller = Caller(config.wire, token=config.token, peer_id=worker_id, host_id=host_id, address=stores,
                        tls=config.tls)
        gs = GlobalStoreLink(caller, worker_id, config.worker.heartbeat_interval)
        registry = HandlerRegistry()
        self.parts = WorkerParts(config=config, worker_id=worker_id, host_id=host_id, roles=tuple(sorted(roles)),
                                 caller=caller, gs=gs, peers=Peers(worker_id, caller, gs, registry),
                                 registry=registry, activity=Activity())
        self.storage = StorageRole(self.parts)
        self.services: list[Role] = [service for role, build in ROLES.items() if role in roles
                                     for service in build(self.parts, self.storage)]
        self.loading = _one(self.services, LoadingRole)
        self.gateway = _one(self.services, GatewayRole) if "gateway" in roles else None
        self.kv_home = _one(self.services, ShardHome) if "shard-home" in roles else None
        busy_types: set[type] = set()  # requests that move or hold bytes: background work waits for quiet
        for service in self.services:
            before = registry.types()
            service.register(registry)
            if isinstance(service, _MOVES_BYTES):
                busy_types |= registry.types() - before

        def on_request(msg: object) -> None:
            if type(msg) in busy_types:
                self.parts.activity.touch()

        self.server = RpcServer(registry, config.wire, token=config.token, server_id=worker_id, host_id=host_id,
                                roles=self.parts.roles, on_request=on_request, tls=config.tls)
        self.address = ""
        self._heartbeats: asyncio.Task[None] | None = None
        metrics.set_enabled(config.metrics.enabled)
        tracing.configure(config.tracing, f"tensorcast-worker-{worker_id}", roots=False)
        self.http = HttpServer(config.token, {"/healthz": self._healthz}, tls=config.tls,
                                 allowed_hosts=config.metrics.allowed_hosts) \
            if config.metrics.enabled else None
        self.metrics_url = ""
        self._source: int | None = None

    @property
    def worker_id(self) -> str:
        return self.parts.worker_id

    @property
    def roles(self) -> tuple[str, ...]:
        return self.parts.roles

    def info(self) -> WorkerInfo:
        events = self.kv_home.events if self.kv_home is not None else None
        return msgspec.structs.replace(
            self.storage.info(self.address), metrics_url=self.metrics_url,
            kv_events_url=self._reachable(events.endpoint if events else ""),
            kv_events_replay_url=self._reachable((events.replay_endpoint or "") if events else ""))

    def _reachable(self, endpoint: str) -> str:
        """An endpoint as bound, a wildcard bind named by this worker's host."""
        host = self.address.rpartition(":")[0]
        for wildcard in ("tcp://0.0.0.0:", "tcp://[::]:"):
            if endpoint.startswith(wildcard) and host:
                return f"tcp://{host}:{endpoint.removeprefix(wildcard)}"
        return endpoint

    def problem(self) -> str:
        """What stops this worker from serving ("" when nothing): its data plane's loop stopped."""
        return "" if self.storage.data_server.healthy() else "the data-plane server stopped serving"

    async def _healthz(self, query: str) -> Response:
        problem = self.problem()
        return Response(f"{problem}\n".encode(), status=503) if problem else Response(b"ok\n")

    def _heartbeat_load(self) -> WorkerLoad:
        return self.storage.heartbeat_load(self.gateway.plans.in_flight if self.gateway is not None else 0)

    async def _register(self, timeout: float) -> None:
        async def announce() -> None:
            await self.loading.restore_checkpoints()
            await self.storage.announce()

        await self.parts.gs.register(self.info, announce, deadline=clock.time() + timeout)

    async def start(self) -> str:
        cfg = self.parts.config.worker
        self.address = self.parts.address = await self.server.start(cfg.host, cfg.port)
        if self.http is not None:
            self.metrics_url = await self.http.start(self.parts.config.metrics.host or cfg.host,
                                                     self.parts.config.metrics.port)
            self._source = metrics.add_source(
                lambda: worker_samples(self.worker_id, self.storage, self.kv_home, self.gateway))
        self.storage.data_server.start(cfg.host, cfg.data_port)  # worker.data_port: 0 = a free port
        await self._register(_REGISTER_TIMEOUT)
        for service in self.services:
            await service.start()
        self._heartbeats = asyncio.ensure_future(self.parts.gs.heartbeat_loop(
            self._heartbeat_load, self.storage.drop, lambda: self._register(5.0), self.problem))
        log.info("worker %s serving at %s (data %s) roles=%s memory=%d disk=%s", self.worker_id, self.address,
                 self.storage.data_server.address, ",".join(self.roles), cfg.memory_capacity, cfg.disk_dir or "-")
        advise_if_small_pages(SHM_DIR)
        return self.address

    async def stop(self, drain: bool = False) -> None:
        """Stop serving. ``drain``: first hand this worker's KV shards over to the other shard homes (while
        it still serves them and heartbeats), so that a graceful stop loses no page."""
        if drain and self.kv_home is not None:
            await self.kv_home.drain()
        if self._heartbeats is not None:
            self._heartbeats.cancel()
        await self.server.close()
        if self.http is not None:
            await self.http.close()
        if self._source is not None:
            metrics.remove_source(self._source)
        for service in reversed(self.services):
            await service.stop()
        await self.parts.gs.close()
        await self.parts.caller.close()


async def run_worker(config: Config, worker_id: str, gs_address: str, ready_file: Path | None = None,
                     stop: asyncio.Event | None = None, drain: asyncio.Event | None = None) -> None:
    """Serve a worker until ``stop`` is set; if ``drain`` is set by then, hand its KV shards over first. With
    ``worker.data_dir``, the directory is locked for the life of this process, and a dead predecessor's shared
    memory freed, before anything is created (``worker.datadir``). Without a token, it listens on loopback only
    (its RPC and data ports, its metrics endpoint): refused before anything starts."""
    check_bind(config.worker.host, config.token, f"worker {worker_id}")
    if config.metrics.enabled:
        check_bind(config.metrics.host or config.worker.host, config.token, "the metrics endpoint (metrics.host)")
    lock = None
    if config.worker.data_dir:
        lock = claim_data_dir(config.worker.data_dir, worker_id, f"{config.worker.shm_prefix}-{worker_id}")
    try:
        await _serve_worker(config, worker_id, gs_address, ready_file, stop, drain)
    finally:
        if lock is not None:
            lock.release()


async def _serve_worker(config: Config, worker_id: str, gs_address: str, ready_file: Path | None,
                        stop: asyncio.Event | None, drain: asyncio.Event | None) -> None:
    worker = Worker(config, worker_id, gs_address)
    try:
        address = await worker.start()
        if ready_file is not None:
            tmp = ready_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({"worker_id": worker_id, "address": address, "pid": os.getpid(),
                                       "host_id": worker.parts.host_id, "roles": list(worker.roles),
                                       "data_address": worker.storage.data_server.address,
                                       "metrics_url": worker.metrics_url}))
            tmp.replace(ready_file)
        await (stop.wait() if stop is not None else asyncio.Event().wait())
    finally:
        await worker.stop(drain=drain is not None and drain.is_set())
