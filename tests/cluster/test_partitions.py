"""Hosts in real network namespaces (``LocalCluster(netns=True)``) and silent partitions between them: a
shard home cut off from the global store steps down before its lease runs out at the store; a client cut
off from its gateway continues through another; after healing, the cluster converges. Every byte read is
checked."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import numpy as np
import pytest
import xxhash

import tensorcast as tc
from tensorcast.cluster import LocalCluster
from tensorcast.errors import StaleFencingToken
from tensorcast.kv.keys import KVLayout, page_keys, shard_of
from tensorcast.netns import ROOT, netns_available
from tensorcast.testing import running_cluster, wait_shards_settled
from tensorcast.wire.kv_messages import KVGet, KVGetReply, KVPut, KVPutReply

LAYOUT = KVLayout("netns-model", layers=1, kv_heads=2, head_dim=32, dtype="float16", page_size=16)
TTL, RENEW, DEAD_PEER = 3.0, 0.5, 3.0
CONFIG = {"kv.lease_ttl": TTL, "kv.renew_interval": RENEW, "wire.dead_peer_timeout": DEAD_PEER,
          "wire.connect_timeout": 2.0, "worker.heartbeat_interval": 0.5}


def page_for(key: str, version: int = 0) -> np.ndarray:
    seed = xxhash.xxh3_64_intdigest(f"{key}/{version}".encode())
    return np.random.default_rng(seed).integers(0, 255, LAYOUT.page_bytes, dtype=np.uint8)


def require_netns() -> None:
    """Skip without network namespaces (root and iproute2), or fail where CI promises them."""
    if not netns_available():
        why = "network namespaces need root and iproute2"
        if os.environ.get("TENSORCAST_REQUIRE_SYSTEM_TOOLS") == "1":
            pytest.fail(why)
        pytest.skip(why)


@pytest.fixture()
def cluster() -> Iterator[LocalCluster]:
    require_netns()
    with running_cluster(workers=2, hosts=2, netns=True, config=CONFIG) as c:
        yield c


def test_shard_home_cut_from_global_store_steps_down_first(cluster: LocalCluster) -> None:
    gateways = [h.address for h in cluster.workers.values()]
    with tc.connect(gateways[0], cluster.token) as c:
        wait_shards_settled(c, {"w0", "w1"})
        table = c.list_shards()
        mine = {lease.shard: lease for lease in table.leases if lease.holder == "w1"}
        keys = [k for k in page_keys(list(range(400 * LAYOUT.page_size)), LAYOUT)
                if shard_of(k, table.num_shards) in mine][:12]
        assert len(keys) == 12
        assert c.kv.put(keys, [page_for(k) for k in keys]) == 12
        tokens = {shard_of(k, table.num_shards): mine[shard_of(k, table.num_shards)].token for k in keys}
        home = mine[shard_of(keys[0], table.num_shards)].address

        def ask_w1() -> KVGetReply:
            return c._run(c.aio.caller.call(KVGet(keys=tuple(keys), tokens=tokens), KVGetReply, address=home))

        assert all(s >= 0 for s in ask_w1().sizes)
        cluster.net.partition(cluster.host_of("w1"), cluster.gs_host)  # type: ignore[union-attr]
        cut = time.time()
        last_served = cut  # when the last answer w1 gave with its pages arrived here (it served it earlier)
        stepped_down = False
        while time.time() < cut + 3 * TTL:
            try:
                ask_w1()
                last_served = time.time()
            except StaleFencingToken:
                stepped_down = True
                break
            time.sleep(0.02)
        assert stepped_down, "w1 kept serving its shards while cut off from the global store"
        # What the store says of those leases now: w1 could not renew them after the cut.
        at_store = {lease.shard: lease for lease in c.list_shards().leases if lease.shard in tokens}
        expiry = min(lease.expiry for lease in at_store.values() if lease.holder == "w1")
        assert last_served < expiry, (last_served - cut, expiry - cut)
        # A write sent to it now is refused: nothing it took after stepping down can be read.
        page = page_for(keys[0], 1)
        with pytest.raises(StaleFencingToken):
            c._run(c.aio.caller.call(KVPut(keys=(keys[0],), sizes=(page.nbytes,), tokens=tokens), KVPutReply,
                                     address=home, payload=memoryview(page)))
        # Its shards move to w0 once they expire at the store; new pages go there.
        deadline = time.monotonic() + TTL + 10
        while any(lease.holder != "w0" for lease in c.list_shards().leases if lease.shard in tokens):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert c.kv.put(keys, [page_for(k, 1) for k in keys]) == 12
        got = c.kv.get(keys)
        assert all(g is not None and np.array_equal(g, page_for(k, 1)) for k, g in zip(keys, got, strict=True))

        cluster.net.heal()  # type: ignore[union-attr]
        wait_shards_settled(c, {"w0", "w1"})  # w1 competes again and gets its shards back, with new tokens
        after = {lease.shard: lease.token for lease in c.list_shards().leases if lease.shard in tokens}
        assert all(after[s] > tokens[s] for s in tokens)
        for k, g in zip(keys, c.kv.get(keys), strict=True):  # a miss (moved homes) or the new bytes, never old
            assert g is None or np.array_equal(g, page_for(k, 1))


def test_client_cut_from_its_gateway_fails_over(cluster: LocalCluster) -> None:
    gateways = [h.address for h in cluster.workers.values()]
    with tc.connect(gateways, cluster.token, config=tc.Config.from_flat(CONFIG | {"client.timeout": 60})) as c:
        data = {"w": np.random.default_rng(7).random((256, 256), dtype=np.float32)}
        art = c.put(data, key="net/a", policy="ha")  # a replica on each host
        assert c.aio.caller.address == gateways[0]
        cluster.net.partition(ROOT, cluster.host_of("w0"))  # type: ignore[union-attr]
        t0 = time.monotonic()
        assert c.artifact("net/a").id == art.id  # through w1 now
        failover = time.monotonic() - t0
        assert c.aio.caller.address == gateways[1]
        got = c.artifact("net/a").tensor("w", like="numpy")  # from w1's replica: w0's data plane is cut too
        assert np.array_equal(got, data["w"])
        more = c.put({"x": np.arange(100)}, key="net/b")
        assert failover < 2 * DEAD_PEER + 5, failover
        cluster.net.heal()  # type: ignore[union-attr]
        deadline = time.monotonic() + 20
        while not all(w.alive for w in c.list_workers()):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert np.array_equal(c.artifact(more.id).tensor("x", like="numpy"), np.arange(100))
        assert np.array_equal(c.artifact("net/a").tensor("w", like="numpy"), data["w"])


def test_latency_and_loss_slow_calls_down_without_breaking_them(cluster: LocalCluster) -> None:
    gateways = [h.address for h in cluster.workers.values()]
    net = cluster.net
    assert net is not None
    if not net.netem_available():
        pytest.skip("this kernel has no tc netem (sch_netem): delay and loss cannot be injected here")
    with tc.connect(gateways[1], cluster.token) as c:  # the gateway on w1's host
        data = np.random.default_rng(3).random(1 << 16)

        def round_trip() -> float:
            t0 = time.perf_counter()
            c.list_workers()
            return time.perf_counter() - t0

        before = sorted(round_trip() for _ in range(9))[4]
        net.netem(cluster.host_of("w1"), delay_ms=40, loss_pct=2)
        try:
            slow = sorted(round_trip() for _ in range(9))[4]
            art = c.put({"d": data}, key="slow/a")  # streamed over the lossy link: every chunk checked
            assert np.array_equal(c.artifact(art.id).tensor("d", like="numpy"), data)
        finally:
            net.netem(cluster.host_of("w1"))
        assert slow >= 0.040 > before, (before, slow)
        assert sorted(round_trip() for _ in range(9))[4] < 0.040


def test_hosts_are_removed_even_when_the_test_fails() -> None:
    require_netns()
    import subprocess

    from tensorcast.netns import Hosts

    with pytest.raises(RuntimeError), Hosts(2) as hosts:
        names = list(hosts.names)
        assert all(n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout for n in names)
        raise RuntimeError("a failing test")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names) and hosts.bridge not in links
