"""A simulated cluster: a global store and workers with every role, and clients, as objects in one event loop.

Owns: building the processes from the real roles (``gs.service.GlobalStore`` over an in-memory SQLite backend;
per worker the roles of ``worker.server.ROLES`` — ``StorageRole`` with a small memory tier and a disk tier in a
directory of its own, ``LoadingRole``, ``GatewayRole``, ``ShardHome`` — its global-store link, heartbeats and
replica announcements; ``client.kv.AsyncKV``), each behind a ``SimCaller`` on one ``SimNetwork``, worker-to-
worker bytes over the in-process data plane (``SimDataPlane``), and the faults a test or a seeded scenario
injects: kill (its memory is lost, its disk directory kept), the loss of a machine (kill, and its disk
directory gone), pause and resume (SIGSTOP: it neither sends nor answers meanwhile), a graceful stop (drain),
a restart of the global store (its database survives), adding a worker, and partitions. Clients talk to the
global store directly for the lease table (a gateway only relays it). Does not own: the clock (``sim.loop``),
the network's decisions (``sim.net``) or the invariants (``sim.checker``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

from tensorcast import clock
from tensorcast.client.kv import AsyncKV
from tensorcast.client.locality import Locality
from tensorcast.config import Config, KVConfig
from tensorcast.gs.service import GlobalStore
from tensorcast.gs.sqlite import SqliteBackend
from tensorcast.kv.home import ShardHome
from tensorcast.pool.segments import SHM_DIR, remove_stale_segments
from tensorcast.records import WorkerInfo
from tensorcast.testing.sim.net import PROCESS, SimCaller, SimDataPlane, SimNetwork
from tensorcast.wire.rpc import HandlerRegistry
from tensorcast.worker.gateway import GatewayRole
from tensorcast.worker.gs_link import GlobalStoreLink
from tensorcast.worker.loading import LoadingRole
from tensorcast.worker.peers import Peers
from tensorcast.worker.roles import Activity, Role, WorkerParts
from tensorcast.worker.server import ROLES
from tensorcast.worker.storage import StorageRole

__all__ = ["SimCluster", "SimSettings", "SimWorker"]

GS = "gs"


@dataclass(frozen=True)
class SimSettings:
    homes: int = 3
    num_shards: int = 16
    lease_ttl: float = 3.0
    renew_interval: float = 1.0
    lease_margin: float = 0.2
    replicas: int = 1
    heartbeat_interval: float = 1.0
    liveness_timeout: float = 5.0
    memory_capacity: int = 2 << 20  # each worker's memory tier: small, so that puts evict (durable: disk stays)

    def config(self, **worker: Any) -> Config:
        """The cluster's configuration; ``worker``: a worker's own keys (``disk_dir`` ...) under ``worker.``."""
        return Config.from_flat({
            "gs.kv_num_shards": self.num_shards, "gs.worker_liveness_timeout": self.liveness_timeout,
            "gs.lease_reap_interval": 0.5, "worker.heartbeat_interval": self.heartbeat_interval,
            "kv.lease_ttl": self.lease_ttl, "kv.renew_interval": self.renew_interval,
            "kv.lease_margin": self.lease_margin, "kv.replicas": self.replicas, "kv.memory_capacity": 64 << 20,
            "kv.arena_bytes": 1 << 20, "kv.max_page_bytes": 1 << 16, "kv.handover_keep_seconds": 30.0,
            "kv.request_timeout": 2.0, "kv.handover_timeout": 10.0, "metrics.enabled": False,
            "transport.kind": "inproc", "worker.memory_capacity": self.memory_capacity,
            "worker.prefault_bytes": 0, "worker.verify_idle_bytes": 0, "worker.arena_bytes": 1 << 20,
            "worker.small_object_bytes": 64 << 10, "worker.disk_capacity": 256 << 20,
            "worker.repair_interval": 10.0,  # durable artifacts want one copy: repairs find nothing to do
            **{f"worker.{k}": v for k, v in worker.items()}})


class SimWorker:
    """A worker with every role (``worker.server.ROLES``), built as ``worker.server.Worker`` builds them, on a
    ``SimCaller``; each worker is a host of its own, with its data server on the in-process data plane."""

    def __init__(self, cluster: SimCluster, worker_id: str) -> None:
        self.id = worker_id
        self.cluster = cluster
        self.disk_dir = os.path.join(cluster.tmp, worker_id)
        self.config = config = cluster.settings.config(
            disk_dir=self.disk_dir, shm_prefix=cluster.prefix, host_id=worker_id, roles=list(ROLES))
        registry = HandlerRegistry()
        self.caller = SimCaller(cluster.net, worker_id, GS, timeout=5.0)
        self.link = GlobalStoreLink(self.caller, worker_id, config.worker.heartbeat_interval)
        self.parts = WorkerParts(config=config, worker_id=worker_id, host_id=worker_id, roles=tuple(sorted(ROLES)),
                                 caller=self.caller, gs=self.link,
                                 peers=Peers(worker_id, self.caller, self.link, registry), registry=registry,
                                 activity=Activity(), address=worker_id)
        self.storage = StorageRole(self.parts, transport=SimDataPlane(cluster.net, worker_id))
        self.services: list[Role] = [s for build in ROLES.values() for s in build(self.parts, self.storage)]
        self.loading = next(s for s in self.services if isinstance(s, LoadingRole))
        self.gateway = next(s for s in self.services if isinstance(s, GatewayRole))
        self.home = next(s for s in self.services if isinstance(s, ShardHome))
        for service in self.services:
            service.register(registry)
        self.proc = cluster.net.add(worker_id, registry)
        self.heartbeats: asyncio.Task[None] | None = None

    def info(self) -> WorkerInfo:
        return self.storage.info(self.id)

    async def _announce(self) -> None:
        await self.loading.restore_checkpoints()
        await self.storage.announce()

    async def start(self) -> None:
        token = PROCESS.set(self.id)  # its tasks are its own (a kill stops them; their log records name it)
        try:
            address = self.storage.data_server.start("", 0)
            self.cluster.net.data_owner[address] = self.id
            await self.link.register(self.info, self._announce, deadline=clock.time() + 60)
            for service in self.services:
                await service.start()
            self.heartbeats = asyncio.ensure_future(self.link.heartbeat_loop(
                lambda: self.storage.heartbeat_load(self.gateway.plans.in_flight), self.storage.drop,
                lambda: self.link.register(self.info, self._announce, clock.time() + 5)))
        finally:
            PROCESS.reset(token)

    @property
    def alive(self) -> bool:
        return self.proc.alive

    def kill(self) -> None:
        """kill -9: every task it ran stops, everything it held in memory is gone; its disk directory stays."""
        self.proc.alive = False
        self.proc.resumed.set()
        for task in list(self.proc.tasks):
            task.cancel()
        self.home.halt()
        self.storage.halt()

    def lose_disk(self) -> None:
        """The machine is gone: its disk directory with it (call after ``kill``)."""
        shutil.rmtree(self.disk_dir, ignore_errors=True)

    async def drain(self) -> int:
        """A graceful stop: hand the shards over, then stop (its disk stays, but it never comes back)."""
        left = await self.home.drain()
        self.kill()
        return left


class SimCluster:
    def __init__(self, settings: SimSettings, seed: int, *, drop: float = 0.0) -> None:
        self.settings = settings
        self.config = settings.config()
        self.rng = random.Random(seed)
        self.net = SimNetwork(self.rng, drop=drop)
        self.prefix = f"tcsim{os.getpid()}s{seed}"
        # The workers' disk tiers: in /dev/shm where there is one (an fsync there costs nothing).
        self.tmp = tempfile.mkdtemp(prefix=f"{self.prefix}disk", dir=SHM_DIR if os.path.isdir(SHM_DIR) else None)
        self.backend = SqliteBackend(":memory:")
        self.gs: GlobalStore | None = None
        self._gs_tasks: list[asyncio.Task[None]] = []
        self.workers: dict[str, SimWorker] = {}
        self._next = 0
        self.clients: list[AsyncKV] = []

    @property
    def kv_config(self) -> KVConfig:
        return self.config.kv

    async def start(self) -> None:
        asyncio.get_running_loop().set_task_factory(self.net.task_factory)
        await self.backend.open()
        self._start_gs()
        for _ in range(self.settings.homes):
            await self.add_worker()

    def _start_gs(self) -> None:
        self.gs = GlobalStore(self.backend, self.config)
        self.net.add(GS, self.gs.registry)
        token = PROCESS.set(GS)
        self._gs_tasks = [asyncio.ensure_future(self.gs.reap_leases())]
        PROCESS.reset(token)

    def kill_gs(self) -> None:
        proc = self.net.processes[GS]
        proc.alive = False
        for task in [*self._gs_tasks, *proc.tasks]:
            task.cancel()

    def restart_gs(self) -> None:
        """A new global-store process on the same database (its lease table and records survive)."""
        self.kill_gs()
        self._start_gs()

    async def add_worker(self) -> SimWorker:
        wid = f"w{self._next}"
        self._next += 1
        worker = SimWorker(self, wid)
        self.workers[wid] = worker
        await worker.start()
        return worker

    async def restart(self, dead: SimWorker) -> SimWorker:
        """The same worker id started again: a new process, without the old one's memory (with its disk
        directory, unless the machine was lost)."""
        fresh = SimWorker(self, dead.id)
        self.workers[dead.id] = fresh
        await fresh.start()
        return fresh

    def live(self) -> list[SimWorker]:
        return [w for w in self.workers.values() if w.alive]

    def client(self) -> AsyncKV:
        name = f"c{len(self.clients)}"
        kv = AsyncKV(SimCaller(self.net, name, GS, timeout=10.0), Locality(name, shared_memory=False),
                     self.kv_config)
        self.clients.append(kv)
        return kv

    def pause(self, worker: SimWorker) -> None:
        worker.proc.resumed.clear()

    def resume(self, worker: SimWorker) -> None:
        worker.proc.resumed.set()

    async def close(self) -> None:
        for kv in self.clients:
            with contextlib.suppress(Exception):
                await kv.aclose()
        for worker in self.workers.values():
            if worker.alive:
                worker.kill()
        self.kill_gs()
        await self.backend.close()
        for worker in self.workers.values():
            remove_stale_segments(f"{self.prefix}-{worker.id}")
        shutil.rmtree(self.tmp, ignore_errors=True)
