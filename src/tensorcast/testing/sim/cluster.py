"""A simulated cluster: a global store, shard homes and KV clients as objects in one event loop.

Owns: building the processes from the real roles (``gs.service.GlobalStore`` over an in-memory SQLite backend,
``kv.home.ShardHome`` with its global-store link and heartbeats, ``client.kv.AsyncKV``), each behind a
``SimCaller`` on one ``SimNetwork``, and the faults a test or a seeded scenario injects: kill (its memory is
lost), pause and resume (SIGSTOP: it neither sends nor answers meanwhile), a graceful stop (drain), a restart
of the global store (its database survives), adding a worker, and partitions. Clients talk to the global
store directly for the lease table (a gateway only relays it). Does not own: the clock (``sim.loop``), the
network's decisions (``sim.net``) or the invariants (``sim.checker``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from dataclasses import dataclass
from typing import Any

from tensorcast import clock
from tensorcast.client.kv import AsyncKV
from tensorcast.client.locality import Locality
from tensorcast.config import Config, KVConfig
from tensorcast.gs.service import GlobalStore
from tensorcast.gs.sqlite import SqliteBackend
from tensorcast.kv.home import ShardHome
from tensorcast.pool.segments import remove_stale_segments
from tensorcast.records import WorkerInfo, WorkerLoad
from tensorcast.testing.sim.net import PROCESS, SimCaller, SimNetwork
from tensorcast.wire.rpc import HandlerRegistry
from tensorcast.worker.gs_link import GlobalStoreLink

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

    def config(self) -> Config:
        return Config.from_flat({
            "gs.kv_num_shards": self.num_shards, "gs.worker_liveness_timeout": self.liveness_timeout,
            "gs.lease_reap_interval": 0.5, "worker.heartbeat_interval": self.heartbeat_interval,
            "kv.lease_ttl": self.lease_ttl, "kv.renew_interval": self.renew_interval,
            "kv.lease_margin": self.lease_margin, "kv.replicas": self.replicas, "kv.memory_capacity": 64 << 20,
            "kv.arena_bytes": 1 << 20, "kv.max_page_bytes": 1 << 16, "kv.handover_keep_seconds": 30.0,
            "kv.request_timeout": 2.0, "kv.handover_timeout": 10.0, "metrics.enabled": False})


class SimWorker:
    """A worker with the shard-home role: its heartbeats and its ``ShardHome``."""

    def __init__(self, cluster: SimCluster, worker_id: str) -> None:
        self.id = worker_id
        self.cluster = cluster
        registry = HandlerRegistry()
        config = cluster.config
        self.caller = SimCaller(cluster.net, worker_id, GS, timeout=5.0)
        self.link = GlobalStoreLink(self.caller, worker_id, config.worker.heartbeat_interval)
        self.home = ShardHome(worker_id, config.kv, self.caller, f"{cluster.prefix}-{worker_id}")
        self.home.register(registry)
        self.proc = cluster.net.add(worker_id, registry)
        self._tasks: list[asyncio.Task[Any]] = []

    def info(self) -> WorkerInfo:
        return WorkerInfo(worker_id=self.id, address=self.id, host_id=self.id, roles=("basic", "shard-home"),
                          memory_capacity=1 << 30)

    async def start(self) -> None:
        async def announce() -> None:
            return None

        token = PROCESS.set(self.id)  # its loops' tasks are its own (their log records name it)
        try:
            await self.link.register(self.info, announce, deadline=clock.time() + 60)
            await self.home.start()
            load = WorkerLoad(memory_capacity=1 << 30)
            self._tasks.append(asyncio.ensure_future(self.link.heartbeat_loop(
                lambda: load, lambda aid: None, lambda: self.link.register(self.info, announce, clock.time() + 5))))
        finally:
            PROCESS.reset(token)

    @property
    def alive(self) -> bool:
        return self.proc.alive

    def kill(self) -> None:
        """kill -9: everything it held in memory is gone."""
        self.proc.alive = False
        self.proc.resumed.set()
        for task in [*self._tasks, *self.proc.tasks]:
            task.cancel()
        self.home.halt()

    async def drain(self) -> int:
        """A graceful stop: hand the shards over, then stop."""
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
