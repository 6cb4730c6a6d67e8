"""The global store beyond one machine: metadata operations on SQLite vs etcd (1 and 3 members) and shard-lease
failover time vs the lease TTL, measured in one run. (Transfers between real hosts in network namespaces
against a raw socket: ``benchmarks/transfer.py --netns``.)

1. Metadata ops through a global-store process (the RPC a worker sends), per backend: CommitArtifact (a new
   artifact with a key; of a memory replica, which commits without an fsync, and of a disk replica, which
   waits for one), each sent alone and through a worker's group commit (``worker.commit_group``: with 32 in
   flight, those arriving while a group is on its way go together in the next), GetArtifact, Heartbeat and
   RenewShards (64 shards); p50/p99 one at a time, and ops/s with 32 in flight, with 64 workers registered (a
   64-worker cluster's table). Baseline: the same process on SQLite (FULL sync, the embedded default); for the
   group commit, the same commits sent alone.
2. Shard-lease failover: kill -9 a shard home of a 3-worker cluster and time until every shard it held is
   held by a survivor, for several ``kv.lease_ttl`` (renew interval TTL/4); the bound is TTL + renew interval.

Needs Debian ``etcd-server`` for the etcd columns (SQLite only otherwise, saying so).

``--smoke``: 32 operations of each kind, one lease TTL (1 s), every backend (figures meaningless).

Usage: python benchmarks/metadata.py [--quick | --smoke] [--json PATH]
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import tensorcast as tc
from benchlib import Table, parse_args, parser, pct, pick, write_json
from tensorcast.config import Config
from tensorcast.kv.hrw import assignment
from tensorcast.records import ArtifactInfo, TensorMeta, WorkerInfo, WorkerLoad
from tensorcast.testing.etcd import EtcdCluster, etcd_binary
from tensorcast.wire.caller import Caller
from tensorcast.wire.kv_messages import AcquireShards, RenewShards
from tensorcast.wire.messages import (
    CommitArtifact,
    GetArtifact,
    Heartbeat,
    RegisterWorker,
)
from tensorcast.worker.commit_group import CommitGroup

# Workers registered with the global store during the metadata ops (one of them the benchmark's own).
CLUSTER_WORKERS = 64


async def _metadata_ops(address: str, n: int) -> dict[str, float]:
    caller = Caller(Config().wire, token=None, peer_id="bench", host_id="bench", address=address)
    worker = WorkerInfo(worker_id="bench-w", address="127.0.0.1:1", host_id="bench", roles=("basic",))
    inc = (await caller.call(RegisterWorker(worker=worker))).incarnation
    for i in range(1, CLUSTER_WORKERS):  # the workers table of a cluster this size
        await caller.call(RegisterWorker(worker=WorkerInfo(worker_id=f"bench-w{i}", address="127.0.0.1:1",
                                                           host_id=f"bench-{i}", roles=("basic",))))
    shards = tuple(range(64))
    grants = await caller.call(AcquireShards(worker_id="bench-w", shards=shards, ttl=60.0))
    tokens = tuple(g.token for g in sorted(grants.leases, key=lambda g: g.shard))
    seq = iter(range(10**9))

    def artifact() -> ArtifactInfo:
        i = next(seq)
        t = TensorMeta(name="t", dtype="uint8", shape=(8,), nbytes=8, digest=f"{i:064x}")
        return ArtifactInfo(id=f"tc-{i:032x}", tensors=(t,), nbytes=8)

    group = CommitGroup(caller.call)

    def commit(tiers: tuple[str, ...]) -> CommitArtifact:
        return CommitArtifact(artifact=artifact(), worker_id="bench-w", key=f"bench/{next(seq)}", tiers=tiers)

    ops: dict[str, Any] = {
        "commit": lambda: caller.call(commit(("memory",))),
        "commit, grouped": lambda: group.commit(commit(("memory",)), caller.context()),
        "commit disk": lambda: caller.call(commit(("disk",))),
        "commit disk, grouped": lambda: group.commit(commit(("disk",)), caller.context()),
        "get": lambda: caller.call(GetArtifact(key_or_id="bench/1")),
        "heartbeat": lambda: caller.call(Heartbeat(worker_id="bench-w", incarnation=inc,
                                                   load=WorkerLoad(memory_capacity=1))),
        "renew 64 shards": lambda: caller.call(RenewShards(worker_id="bench-w", shards=shards, tokens=tokens,
                                                           ttl=60.0)),
    }
    out: dict[str, float] = {}
    for name, op in ops.items():
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            await op()
            times.append(time.perf_counter() - t0)
        out[f"{name} p50 ms"] = pct(times, 50) * 1e3
        out[f"{name} p99 ms"] = pct(times, 99) * 1e3
        t0 = time.perf_counter()
        for _ in range(max(1, n // 32)):
            await asyncio.gather(*(op() for _ in range(32)))
        out[f"{name} ops/s"] = 32 * max(1, n // 32) / (time.perf_counter() - t0)
    await group.close()
    await caller.close()
    return out


def bench_metadata(backend: str, n: int) -> dict[str, float]:
    """One global-store process on ``backend`` ("sqlite", "etcd-1", "etcd-3"); its ops as a worker sees them."""
    members = 0 if backend == "sqlite" else int(backend.split("-")[1])
    with contextlib.ExitStack() as stack:
        kw: dict[str, Any] = {}
        if members:
            etcd = stack.enter_context(EtcdCluster(members))
            kw = {"etcd": etcd.urls}
        # No shard homes: the benchmark's own "worker" takes the shard leases it renews.
        cluster = stack.enter_context(tc.LocalCluster(workers=1, roles=("basic", "gateway"), **kw))
        return asyncio.run(_metadata_ops(cluster.gs_address, n))


def bench_failover(ttl: float, etcd: str | None) -> float:
    """Seconds from kill -9 of a shard home until all its shards are held by the survivors."""
    config = {"kv.lease_ttl": ttl, "kv.renew_interval": ttl / 4, "kv.lease_margin": min(0.2, ttl / 8)}
    with tc.LocalCluster(workers=3, config=config, etcd=etcd) as cluster, tc.connect(cluster.address) as c:
        homes = set(cluster.worker_ids)
        _wait_assigned(c, homes, 60)
        t0 = time.monotonic()
        cluster.kill_worker("w2")
        _wait_assigned(c, homes - {"w2"}, 60)
        return time.monotonic() - t0


def _wait_assigned(c: tc.Client, homes: set[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        t = c.list_shards()
        want = assignment(t.num_shards, homes)
        if sum(1 for lease in t.leases if lease.holder == want[lease.shard] and lease.expiry > t.now) \
                == t.num_shards:
            return
        time.sleep(0.02)
    raise TimeoutError(f"shards not settled on {homes}")


def main() -> None:
    args = parse_args(parser(__doc__, "fewer operations and TTLs, about a minute"))
    n = pick(args, 1000, 200, 32)
    backends = ["sqlite"] + (["etcd-1", "etcd-3"] if etcd_binary() else [])
    if not etcd_binary():
        print("etcd not installed (apt-get install etcd-server): SQLite only")
    meta = {b: bench_metadata(b, n) for b in backends}
    ops = list(meta["sqlite"])
    table = Table(("metadata op (one GS process)", "<28"), *((b, ">11.2f") for b in backends))
    table.header()
    for op in ops:
        table.row(op, *(meta[b][op] for b in backends))
    for b in backends[1:]:
        ratios = [meta[b][o] / meta["sqlite"][o] for o in ops if o.endswith("ops/s")]
        print(f"{b}: ops/s {min(ratios):.2f}-{max(ratios):.2f}x SQLite")

    ttls = pick(args, [1.0, 2.0, 4.0], [1.0, 2.0], [1.0])
    stores = {"sqlite": None} | ({"etcd-3": "etcd"} if etcd_binary() else {})
    failover: list[dict[str, float | str]] = []
    print()
    table = Table(("lease TTL s", ">11.1f"), ("backend", ">8"), ("failover s", ">11.2f"),
                  ("bound (TTL + renew) s", ">22.2f"))
    table.header()
    for ttl in ttls:
        for name, kind in stores.items():
            with contextlib.ExitStack() as stack:
                urls = stack.enter_context(EtcdCluster(3)).endpoints if kind else None
                seconds = bench_failover(ttl, urls)
            failover.append({"ttl": ttl, "backend": name, "seconds": seconds, "bound": ttl * 1.25})
            table.row(ttl, name, seconds, ttl * 1.25)

    write_json(args.json, "metadata", args.quick, metadata=meta, failover=failover)


if __name__ == "__main__":
    main()
