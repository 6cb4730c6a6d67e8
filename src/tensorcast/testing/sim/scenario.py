"""Seeded runs of the simulated cluster: a KV workload under faults chosen by the seed, checked throughout.

Owns ``run_seed`` (one run: start the cluster, put and read pages, and put, read and delete durable artifacts
(``sim.artifacts``), while faults happen — kill and restart, the loss of a machine with its disk, pause,
partitions, global-store restarts, joins, drains, lost and delayed messages — then heal everything, let the
shards settle and read every acknowledged page and artifact; the checker runs after every delivered request)
and ``settle``. The same seed gives the same run, exactly, given the same ``PYTHONHASHSEED`` (the runner sets
it): ``python -m tensorcast.testing.sim --seed N`` replays one. Does not own: the invariants
(``sim.checker``) or the cluster (``sim.cluster``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any

from tensorcast import clock
from tensorcast.errors import TensorCastError
from tensorcast.kv.hrw import candidates
from tensorcast.kv.keys import KVLayout, page_keys, shard_of
from tensorcast.testing.sim.artifacts import SimArtifacts
from tensorcast.testing.sim.checker import PAGE_BYTES, Checker, InvariantBroken, lease_table, page_for
from tensorcast.testing.sim.cluster import GS, SimCluster, SimSettings
from tensorcast.testing.sim.loop import VirtualClock, VirtualLoop
from tensorcast.testing.sim.net import PROCESS

__all__ = ["Outcome", "run_seed", "settle", "simulate"]

log = logging.getLogger("tensorcast.sim")
LAYOUT = KVLayout("sim", layers=1, kv_heads=1, head_dim=PAGE_BYTES // 4, dtype="float16", page_size=1)


@dataclass
class Outcome:
    seed: int
    replicas: int = 1
    faults: list[str] = field(default_factory=list)
    acked: int = 0
    read_back: int = 0
    at_risk: int = 0
    artifacts: int = 0  # durable artifact keys that had to be readable at the end (and were)
    checks: int = 0
    virtual_seconds: float = 0.0


async def settle(cluster: SimCluster, timeout: float = 60.0) -> None:
    """Until every shard is held, unexpired, by its rank-0 home among the live, running workers."""
    deadline = clock.monotonic() + timeout
    while True:
        homes = sorted(w.id for w in cluster.live() if not w.proc.paused)
        table = lease_table(cluster) if homes else {}
        now = clock.time()
        if homes and all((rec := table.get(s)) is not None and rec[2] > now and rec[0] == candidates(s, homes, 1)[0]
                         for s in range(cluster.settings.num_shards)):
            return
        if clock.monotonic() > deadline:
            raise InvariantBroken(f"the shards did not settle on {homes} within {timeout:g} virtual seconds")
        await asyncio.sleep(0.1)


@contextlib.contextmanager
def _logging(vclock: VirtualClock, path: str | None) -> Iterator[None]:
    """The roles' logs: off (the faults make every role log; the checker says what matters), or, with
    ``path``, every record there stamped with the virtual time (debugging a seed)."""
    root = logging.getLogger("tensorcast")
    saved = root.level, root.handlers[:], root.propagate
    handler: logging.Handler | None = None
    if path:
        handler = logging.FileHandler(path, mode="w")
        handler.setFormatter(_VirtualFormatter(vclock))
        root.handlers[:] = [handler]
        root.setLevel(logging.DEBUG)
        root.propagate = False
    else:
        root.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        root.setLevel(saved[0])
        root.handlers[:], root.propagate = saved[1], saved[2]
        if handler is not None:
            handler.close()


class _VirtualFormatter(logging.Formatter):
    def __init__(self, vclock: VirtualClock) -> None:
        super().__init__()
        self.vclock = vclock

    def format(self, record: logging.LogRecord) -> str:
        return f"{self.vclock.elapsed:10.4f} {PROCESS.get():>4} {record.name[11:]:<6} {record.getMessage()}"


def where(cluster: SimCluster, key: str) -> str:
    """Where a page is (for a failure's message): its shard's lease, and the homes that store or serve it."""
    n = cluster.settings.num_shards
    shard = shard_of(key, n)
    holder, token, expiry = lease_table(cluster).get(shard, ("", 0, 0.0))
    stored = [w.id for w in cluster.live() if key in w.home.store.index]
    serving = [w.id for w in cluster.live() if w.home.served.token(shard)]
    return (f"shard {shard} leased to {holder!r} (token {token}, {expiry - clock.time():+.1f}s); stored on {stored}, "
            f"served by {serving}")


def simulate(seed: int, body: Callable[[SimCluster, Checker], Coroutine[Any, Any, None]],
             settings: SimSettings | None = None, *, drop: float = 0.0,
             log_path: str | None = None) -> tuple[SimCluster, Checker]:
    """Run ``body(cluster, checker)`` on a fresh simulated cluster, on a virtual clock (``log_path``: the
    roles' logs there, stamped with virtual time)."""
    vclock = VirtualClock()
    loop = VirtualLoop(vclock)
    cluster: SimCluster | None = None
    checker: Checker | None = None

    async def main() -> None:
        nonlocal cluster, checker
        cluster = SimCluster(settings or SimSettings(), seed, drop=drop)
        checker = Checker(cluster)
        try:
            await cluster.start()
            await settle(cluster)
            await body(cluster, checker)
        finally:
            await cluster.close()
            tasks = asyncio.all_tasks() - {asyncio.current_task()}
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        checker.raise_failure()

    with _logging(vclock, log_path):
        try:
            with clock.installed(vclock.time, vclock.monotonic):
                loop.run_until_complete(main())
        finally:
            loop.close()
    assert cluster is not None and checker is not None
    return cluster, checker


class _Workload:
    """Puts new pages and reads acknowledged ones, checking every byte."""

    def __init__(self, cluster: SimCluster, checker: Checker, rng: random.Random) -> None:
        self.kv = cluster.client()
        self.checker = checker
        self.rng = rng
        self.seq = 0
        self.artifacts = SimArtifacts(cluster, checker.artifacts, random.Random(rng.random()))

    def keys(self, n: int) -> list[str]:
        self.seq += 1
        return page_keys([self.seq * 1000 + i for i in range(n)], LAYOUT)

    async def step(self) -> None:
        keys = self.keys(self.rng.randint(1, 4))
        with contextlib.suppress(TensorCastError):
            await self.kv.put(keys, [page_for(k) for k in keys])
            self.checker.acked.update(keys)
        if self.checker.acked:
            sample = self.rng.sample(sorted(self.checker.acked), min(8, len(self.checker.acked)))
            with contextlib.suppress(TensorCastError):
                self.checker.read(sample, await self.kv.get(sample))
        await self.artifacts.step()

    async def read_all(self, cluster: SimCluster) -> list[str]:
        """The acknowledged pages not readable: read once the shards settled, and those missing read again
        after they settled again (a lost message can move a shard for a moment: a miss then is not a loss)."""
        keys = sorted(self.checker.acked)
        for _ in range(2):
            await settle(cluster)
            got = await self.kv.get(keys)
            self.checker.read(keys, got)
            keys = [k for k, g in zip(keys, got, strict=True) if g is None]
            if not keys:
                break
        return keys


# Events of an ordinary day, which lose nothing acknowledged; and faults, which may lose what a home held.
ORDINARY = ["gs", "join", "drain", "delay"]
FAULTS = ["kill", "lose", "pause", "partition-gs", "partition-homes"]


async def _fault(cluster: SimCluster, checker: Checker, rng: random.Random, out: Outcome, ordinary: bool) -> None:
    """One event, chosen by the seed, and its end after a while."""
    ttl = cluster.settings.lease_ttl
    live = cluster.live()
    kind = rng.choice(ORDINARY if ordinary else ORDINARY + FAULTS)
    if kind in ("kill", "lose", "pause", "drain", "partition-gs") and len(live) < 2:
        kind = "join"
    if kind == "partition-homes" and len(live) < 2:
        kind = "gs"
    victim = rng.choice(live) if live else None
    named = victim is not None and kind not in ("gs", "join", "delay")
    out.faults.append(f"{clock.monotonic() - 10_000:.2f}s {kind}{' ' + victim.id if named and victim else ''}")
    log.info("FAULT %s", out.faults[-1])
    if kind in ("kill", "lose") and victim is not None:
        checker.killed(victim)
        victim.kill()
        if kind == "lose":  # the machine is gone: a new one takes its id, with an empty disk
            checker.artifacts.disk_gone(victim)
            victim.lose_disk()
        await asyncio.sleep(rng.uniform(0, 2 * ttl))
        await cluster.restart(victim)
    elif kind == "pause" and victim is not None:
        checker.risk(victim)
        cluster.pause(victim)
        await asyncio.sleep(rng.uniform(0.2, 2.5 * ttl))
        checker.risk(victim)
        cluster.resume(victim)
    elif kind == "gs":
        cluster.kill_gs()
        await asyncio.sleep(rng.uniform(0.2, 2 * ttl))
        cluster.restart_gs()
    elif kind in ("partition-gs", "partition-homes") and victim is not None:
        other = GS if kind == "partition-gs" else rng.choice([w.id for w in live if w is not victim])
        sides = [victim, *(w for w in live if w.id == other)]  # a hand-over across the cut leaves pages behind
        for w in sides:
            checker.risk(w)
        cluster.net.partition(victim.id, other)
        await asyncio.sleep(rng.uniform(0.2, 2 * ttl))
        for w in sides:
            checker.risk(w)  # and what they took meanwhile
        cluster.net.heal(victim.id, other)
    elif kind == "join":
        await cluster.add_worker()
    elif kind == "drain" and victim is not None:
        if victim.home.homes == [victim.id]:  # no other home it can hand its pages to (cut off, all of them)
            checker.risk(victim)
        await victim.drain()
        checker.artifacts.disk_gone(victim)  # it stopped for good: its disk copies were not handed over
    else:
        cluster.net.latency = (0.001, rng.uniform(0.005, 0.2))
        await asyncio.sleep(rng.uniform(0.5, 2 * ttl))
        cluster.net.latency = (0.0002, 0.002)


def run_seed(seed: int, *, settings: SimSettings | None = None, fault_seconds: float = 30.0,
             drop: float = 0.002, log_path: str | None = None) -> Outcome:
    """One seeded run; ``InvariantBroken`` (with the seed and its faults in the message) if a promise broke."""
    rng = random.Random(seed ^ 0x5EED)
    settings = settings or SimSettings(homes=rng.randint(2, 4), replicas=rng.choice((1, 1, 2)))
    ordinary = rng.random() < 0.5  # half the seeds see only ordinary events: nothing acknowledged may go
    chance = random.Random(seed ^ 0xFA17)  # the faults' own draws: the workload's depend on what succeeded
    out = Outcome(seed, settings.replicas)

    async def body(cluster: SimCluster, checker: Checker) -> None:
        work = _Workload(cluster, checker, rng)
        end = clock.monotonic() + fault_seconds

        async def faults() -> None:
            while clock.monotonic() < end:
                await asyncio.sleep(chance.uniform(0.5, 4.0))
                await _fault(cluster, checker, chance, out, ordinary)

        chaos = asyncio.ensure_future(faults())
        while clock.monotonic() < end or not chaos.done():
            await work.step()
            checker.raise_failure()
            await asyncio.sleep(rng.uniform(0.02, 0.3))
        await chaos
        cluster.net.heal()
        for w in cluster.live():
            cluster.resume(w)
        if not cluster.net.processes[GS].alive:
            cluster.restart_gs()
        if not cluster.live():
            await cluster.add_worker()
        await settle(cluster)
        await asyncio.sleep(2 * cluster.settings.lease_ttl)  # hand-overs in flight end
        missing = await work.read_all(cluster)
        lost = checker.lost(missing)
        out.acked, out.read_back = len(checker.acked), len(checker.acked) - len(missing)
        out.at_risk, out.checks = len(checker.at_risk & checker.acked), checker.checks
        out.virtual_seconds = clock.monotonic() - 10_000
        if lost:
            raise InvariantBroken(f"{len(lost)} acknowledged pages lost with no fault that could lose them: "
                                  f"{lost[:3]}; {where(cluster, lost[0])}; put {checker.stored_at.get(lost[0])}")
        ledger = checker.artifacts
        gone = ledger.lost(await work.artifacts.missing())
        out.artifacts = len(ledger.must_read()) - len(gone)
        if gone:
            raise InvariantBroken(f"{len(gone)} acknowledged durable artifacts lost with no fault that could lose "
                                  f"them: {gone[:3]}; {ledger.where(gone[0])}")

    try:
        simulate(seed, body, settings, drop=drop, log_path=log_path)
    except InvariantBroken as exc:
        raise InvariantBroken(f"seed {seed}: {exc}\nfaults: {'; '.join(out.faults)}") from exc
    return out
