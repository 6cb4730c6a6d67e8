"""The global store on a real 3-member etcd cluster, served by two global-store processes: kill -9 etcd
members and global stores under a mixed load (puts, gets, KV pages, plans); every acknowledged write must
still be there afterwards, every byte read must be right, and fencing tokens must never go back."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
import xxhash

import tensorcast as tc
from tensorcast.cluster import LocalCluster
from tensorcast.errors import StaleFencingToken, TensorCastError
from tensorcast.gs.etcd import EtcdBackend
from tensorcast.kv.keys import KVLayout, page_keys, shard_of
from tensorcast.testing import running_cluster, wait_shards_settled
from tensorcast.testing.etcd import EtcdCluster
from tensorcast.testing.tools import require_tool
from tensorcast.wire.kv_messages import KVPut, RenewShards

LAYOUT = KVLayout("etcd-model", layers=1, kv_heads=2, head_dim=32, dtype="float16", page_size=16)
TTL, RENEW, HEARTBEAT = 2.0, 0.5, 0.5
# Liveness at its default (5 s), not shorter: heartbeats go through the global stores to etcd, and across a
# leader election, a global store's death and a busy CI machine, a 3 s liveness once let a worker look dead
# for a moment, and a get found no live replica. No worker is killed here for liveness to find.
CONFIG = {"kv.lease_ttl": TTL, "kv.renew_interval": RENEW, "worker.heartbeat_interval": HEARTBEAT,
          "gs.worker_liveness_timeout": 5.0}
DEADLINE = 30.0  # each caller operation's deadline


def page_for(key: str) -> np.ndarray:
    seed = xxhash.xxh3_64_intdigest(key.encode())
    return np.random.default_rng(seed).integers(0, 255, LAYOUT.page_bytes, dtype=np.uint8)


def tensor_for(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 2**31, 1000 + i, dtype=np.int64)


@pytest.fixture()
def etcd() -> Iterator[EtcdCluster]:
    require_tool("etcd", "etcd-server")
    with EtcdCluster(3) as cluster:
        yield cluster


class Load:
    """Puts, gets, KV pages and plans in a loop from another thread; records what was acknowledged and
    everything that went wrong (any failure, any wrong byte)."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.stop = threading.Event()
        self.acked: dict[str, int] = {}  # key -> seed of its tensor
        self.pages: list[str] = []  # page keys whose put was acknowledged
        self.failures: list[str] = []
        self.slowest = 0.0
        self.rounds = 0
        self.thread = threading.Thread(target=self.run_guarded, daemon=True)

    def _timed(self, what: str, fn: object) -> object:
        t0 = time.monotonic()
        try:
            return fn()  # type: ignore[operator]
        except TensorCastError as exc:
            self.failures.append(f"{what}: {exc}")
            return None
        finally:
            self.slowest = max(self.slowest, time.monotonic() - t0)

    def run(self) -> None:
        config = tc.Config.from_flat({"client.timeout": DEADLINE})
        with tc.connect(self.cluster.address, config=config) as c:
            i = 0
            while not self.stop.is_set():
                key = f"load/{i}"
                if self._timed("put", lambda: c.put({"t": tensor_for(i)}, key=key)) is not None:  # noqa: B023
                    self.acked[key] = i
                got = self._timed("get", lambda: c.artifact(key).tensor("t", like="numpy"))  # noqa: B023
                if key in self.acked and got is not None and not np.array_equal(got, tensor_for(i)):
                    self.failures.append(f"wrong bytes for {key}")
                keys = page_keys([i * 7919 + j for j in range(2 * LAYOUT.page_size)], LAYOUT)
                if self._timed("kv put", lambda: c.kv.put(keys, [page_for(k) for k in keys])) is not None:  # noqa: B023
                    self.pages += keys
                for k, g in zip(keys, self._timed("kv get", lambda: c.kv.get(keys)) or [], strict=True):  # noqa: B023
                    if g is not None and not np.array_equal(g, page_for(k)):
                        self.failures.append(f"wrong page {k}")
                if i % 5 == 0 and key in self.acked:
                    outcome = self._timed("plan", lambda: self._plan(c, key, i))  # noqa: B023
                    if outcome is not None and not outcome.ok:  # type: ignore[attr-defined]
                        self.failures.append(f"plan {i}: {outcome.steps}")  # type: ignore[attr-defined]
                i += 1
                self.rounds += 1

    @staticmethod
    def _plan(c: tc.Client, key: str, i: int) -> object:
        plan = c.plan(ctx=tc.context(timeout=DEADLINE, idempotency_key=f"load-plan-{i}"))
        plan.prefetch(c.artifact(key), to="w1")
        return plan.run().result()

    def run_guarded(self) -> None:
        try:
            self.run()
        except BaseException as exc:  # anything else ends the load: the test must see it
            self.failures.append(f"load thread died: {exc!r}")
            raise

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=120)


def _check_acknowledged(cluster: LocalCluster, load: Load) -> None:
    """Every acknowledged key still resolves to its bytes; every acknowledged page that is still held is right."""
    with tc.connect(cluster.address) as c:
        for key, seed in load.acked.items():
            assert np.array_equal(c.artifact(key).tensor("t", like="numpy"), tensor_for(seed)), key
        got = c.kv.get(load.pages)
        assert all(g is None or np.array_equal(g, page_for(k)) for k, g in zip(load.pages, got, strict=True))


def test_etcd_members_and_global_stores_killed_under_load(etcd: EtcdCluster) -> None:
    with running_cluster(workers=2, etcd=etcd.urls, global_stores=2, config=CONFIG) as cluster:
        with Load(cluster) as load:
            time.sleep(2.0)
            leader = etcd.leader()
            etcd.kill(leader)  # a new leader is elected; callers wait for it, within their deadlines
            time.sleep(3.0)
            etcd.restart(leader)
            follower = next(i for i in range(3) if i != etcd.leader())
            etcd.kill(follower)  # a quorum remains: nothing to wait for
            time.sleep(2.0)
            cluster.kill_global_store(0)  # workers and gateways continue through the other one
            time.sleep(3.0)
            rounds_after_gs_death = load.rounds
            time.sleep(3.0)
            assert load.rounds > rounds_after_gs_death, "the load stalled after a global store died"
            etcd.restart(follower)
            cluster.restart_global_store(0)
            time.sleep(2.0)
        assert not load.failures, load.failures[:5]
        assert load.rounds > 10 and len(load.acked) > 10, load.rounds
        assert load.slowest < DEADLINE
        _check_acknowledged(cluster, load)
        with tc.connect(cluster.address) as c:  # both workers stayed alive through it all
            assert all(w.alive for w in c.list_workers())


def test_stale_fencing_tokens_rejected_after_etcd_leader_changes(etcd: EtcdCluster) -> None:
    with running_cluster(workers=2, etcd=etcd.urls, global_stores=2, config=CONFIG) as cluster, \
            tc.connect(cluster.address) as c:
        # Both global stores announce themselves: any client lists both metrics endpoints.
        stores = {url for name, url in c.metrics_urls().items() if name.startswith("gs")}
        assert stores == {cluster.metrics_urls["gs"], cluster.metrics_urls["gs1"]}
        wait_shards_settled(c, {"w0", "w1"})  # every shard held by its HRW home (both hold their share)
        table = c.list_shards()
        paused = "w1"
        old = {lease.shard: lease for lease in table.leases if lease.holder == paused}
        assert old
        key = next(k for k in page_keys(list(range(64 * LAYOUT.page_size)), LAYOUT)
                   if shard_of(k, table.num_shards) in old)
        shard = shard_of(key, table.num_shards)
        etcd.kill(etcd.leader())
        cluster.pause_worker(paused)
        try:
            time.sleep(TTL + 2 * RENEW + 1.0)  # its leases expire; w0 takes them over with new tokens
            etcd.restart(next(i for i in range(3) if not etcd.healthy(i)))
            etcd.kill(etcd.leader())  # and the leader changes once more
            deadline = time.monotonic() + 20
            while True:
                now = {lease.shard: lease for lease in c.list_shards().leases}
                if now[shard].holder == "w0":
                    break
                assert time.monotonic() < deadline, now[shard]
                time.sleep(0.2)
        finally:
            cluster.resume_worker(paused)
        assert now[shard].token > old[shard].token
        page = page_for(key)
        with pytest.raises(StaleFencingToken):  # the old token, at the new holder
            c._run(c.aio.caller.call(KVPut(keys=(key,), sizes=(page.nbytes,), tokens={shard: old[shard].token}),
                                     address=now[shard].address, payload=memoryview(page)))
        gs = tc.connect(cluster.gs_addresses[1])
        try:  # nor does any global store renew it
            reply = gs._run(gs.aio.caller.call(RenewShards(worker_id=paused, shards=(shard,),
                                                            tokens=(old[shard].token,), ttl=TTL)))
            assert reply.leases == ()
        finally:
            gs.close()
        later = {lease.shard: lease.token for lease in c.list_shards().leases}
        assert all(later[s] >= now[s].token for s in now)  # tokens never went back


def test_restarted_worker_reannounces_and_rejoins_on_etcd(etcd: EtcdCluster) -> None:
    with running_cluster(workers=2, etcd=etcd.urls, config=CONFIG) as cluster, tc.connect(cluster.address) as c:
        data = {"w": tensor_for(3)}
        art = c.put(data, key="durable/a", policy="durable")  # on w0's disk tier
        c.artifact("durable/a").prefetch(to="w1").result(timeout=30)
        cluster.kill_worker("w1")  # its shards move to w0 once their leases expire
        deadline = time.monotonic() + TTL + 10
        while any(lease.holder == "w1" and lease.expiry > c.list_shards().now for lease in c.list_shards().leases):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        # While w0 is down, its replica records go (as after a store whose records were lost): only w0's
        # announcement on restart can bring its disk replica back.
        cluster.kill_worker("w0")
        left = asyncio.run(forget_replicas(etcd.endpoints, cluster.etcd_prefix, art.id, "w0"))
        assert [w for w, _ in left if w == "w0"] == []
        cluster.restart_worker("w0")  # w0 comes back: its disk replica is announced again
        deadline = time.monotonic() + 30
        while True:
            info = c.artifact(art.id).info
            tiers = {(r.worker_id, r.tier) for r in info.replicas if r.alive}
            if ("w0", "disk") in tiers:
                break
            assert time.monotonic() < deadline, tiers
            time.sleep(0.2)
        cluster.restart_worker("w1")
        wait_shards_settled(c, {"w0", "w1"})  # both compete for shards again: the HRW assignment returns
        assert np.array_equal(c.artifact("durable/a").tensor("w", like="numpy"), data["w"])
        # Both restarted homes serve pages again, on their shards' new fencing tokens.
        keys = page_keys(list(range(64 * LAYOUT.page_size)), LAYOUT)
        table = c.list_shards()
        holders = {lease.shard: lease.holder for lease in table.leases}
        assert {holders[shard_of(k, table.num_shards)] for k in keys} == {"w0", "w1"}  # both serve some of them
        c.kv.put(keys, [page_for(k) for k in keys])
        assert all(np.array_equal(g, page_for(k)) for k, g in zip(keys, c.kv.get(keys), strict=True))


async def forget_replicas(endpoints: str, prefix: str, artifact_id: str,
                          worker_id: str) -> list[tuple[str, str]]:
    """Remove ``worker_id``'s replica records of the artifact in etcd; the replicas left."""
    backend = EtcdBackend(endpoints, prefix=prefix)
    await backend.open()
    try:
        for tier in ("memory", "disk"):
            await backend.remove_replica(artifact_id, worker_id, tier)
        return await backend.replicas_of(artifact_id)
    finally:
        await backend.close()


def health_of(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_a_global_store_is_ready_only_while_etcd_has_a_quorum(etcd: EtcdCluster) -> None:
    """Its /healthz (the readiness probe of docs/deployment-kubernetes.md) answers 503 while etcd cannot
    serve, and ok again once it can: a load balancer then sends callers to a store that can answer."""
    with running_cluster(workers=1, etcd=etcd.urls, config=CONFIG) as cluster:
        url = cluster.metrics_urls["gs"]
        assert health_of(url) == (200, b"ok\n")
        etcd.kill(0)
        etcd.kill(1)  # one member of three left: no quorum, no leader
        # The probe's read waits at most the etcd client's call timeout (2 s) before it answers 503.
        deadline = time.monotonic() + 30
        while (got := health_of(url))[0] == 200:
            assert time.monotonic() < deadline, "still ready without an etcd quorum"
            time.sleep(0.2)
        assert got[0] == 503 and got[1].startswith(b"unavailable: etcd"), got
        etcd.restart(0)
        etcd.restart(1)
        deadline = time.monotonic() + 30
        while health_of(url)[0] != 200:
            assert time.monotonic() < deadline, "not ready again after etcd recovered"
            time.sleep(0.2)
