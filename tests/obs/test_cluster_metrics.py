"""Every process of a real cluster serves metrics whose values match what was done to it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import tensorcast as tc
from tensorcast.errors import NotFound
from tensorcast.kv.keys import KVLayout, page_keys
from tensorcast.testing import running_cluster

from .conftest import eventually, scrape, value

HEARTBEAT = 0.5
LEASE_TTL = tc.Config().kv.lease_ttl
RENEW_INTERVAL = tc.Config().kv.renew_interval
LAYOUT = KVLayout("metrics-model", layers=1, kv_heads=1, head_dim=16, dtype="float16", page_size=4)


def _settled(client: tc.Client, cluster: tc.LocalCluster) -> dict[str, float]:
    """Each worker's memory use, once the global store's record (from heartbeats) equals the worker's own
    gauge. Bounded by a few heartbeat intervals."""
    deadline = time.monotonic() + 20 * HEARTBEAT
    while True:
        recorded = {w.worker_id: float(w.memory_used) for w in client.list_workers()}
        gauges = {wid: value(scrape(url), "tensorcast_pool_bytes", tier="memory", state="used")
                  for wid, url in cluster.metrics_urls.items() if wid != "gs"}
        if recorded == gauges or time.monotonic() > deadline:
            assert recorded == gauges
            return gauges
        time.sleep(HEARTBEAT / 2)


def _network_gets(urls: dict[str, str]) -> tuple[float, float, float]:
    """Gets the workers' data servers served over the network, summed: (count, bytes, timed)."""
    per = [scrape(urls[w]) for w in ("w0", "w1")]
    return (sum(value(m, "tensorcast_operations_total", op="get", path="network", outcome="ok") for m in per),
            sum(value(m, "tensorcast_operation_bytes_total", op="get", path="network") for m in per),
            sum(value(m, "tensorcast_operation_seconds_count", op="get", path="network") for m in per))


def test_every_process_serves_what_it_did() -> None:
    config = {"worker.heartbeat_interval": HEARTBEAT}
    with running_cluster(workers=2, memory_capacity="256MiB", config=config) as cluster, \
            tc.connect(cluster.address) as local, \
            tc.connect(cluster.address, config=tc.Config.from_flat({"client.host_id": "elsewhere"})) as remote:
        urls = cluster.metrics_urls
        assert set(urls) == {"gs", "w0", "w1"} and len(set(urls.values())) == 3
        assert local.metrics_urls() == urls

        shm = local.put({"a": np.ones((256, 256), np.float32), "b": np.arange(1000, dtype=np.int64)}, key="m/shm")
        net = remote.put({"c": np.full((300, 100), 7, np.int32)}, key="m/net")
        assert _network_gets(urls) == (0, 0, 0)  # same-host puts, and network puts, read nothing back
        net.prefetch(to="w1").result(timeout=30)
        # The source's data server sent the prefetch's bytes (counted just after the last byte went out), and
        # then the remote read's: both are gets over the network there, timed.
        before = eventually(lambda: _network_gets(urls), lambda g: g[1] == net.nbytes, 20 * HEARTBEAT)
        got = remote.artifact("m/shm").tensor_dict(like="numpy")
        assert np.array_equal(got["b"], np.arange(1000))
        after = eventually(lambda: _network_gets(urls), lambda g: g[1] == net.nbytes + shm.nbytes, 20 * HEARTBEAT)
        assert after[0] >= before[0] + 2  # at least one data-plane request per tensor read
        assert before[2] == before[0] and after[2] == after[0]

        keys = page_keys(list(range(3 * LAYOUT.page_size)), LAYOUT)
        pages = [np.full(LAYOUT.page_bytes, i, np.uint8) for i in range(len(keys))]
        assert local.kv.put(keys[:2], pages[:2]) == 2
        assert sum(p is not None for p in local.kv.get(keys)) == 2  # two hits, one miss

        per = {name: scrape(url) for name, url in urls.items()}
        workers = [per["w0"], per["w1"]]
        assert sum(value(m, "tensorcast_operation_bytes_total", op="put", path="shm") for m in workers) == shm.nbytes
        assert sum(value(m, "tensorcast_operation_bytes_total", op="put", path="network")
                   for m in workers) == net.nbytes
        assert sum(value(m, "tensorcast_transport_bytes_total", transport="shm", direction="received")
                   for m in workers) == shm.nbytes  # written into shared memory by this process
        assert sum(value(m, "tensorcast_transport_bytes_total", transport="rpc", direction="received")
                   for m in workers) == net.nbytes
        assert value(per["w1"], "tensorcast_operation_bytes_total", op="transfer", path="fetch") == net.nbytes
        assert value(per["w1"], "tensorcast_transport_bytes_total", transport="tcp", direction="received") \
            == net.nbytes
        assert sum(value(m, "tensorcast_transport_bytes_total", transport="tcp", direction="sent")
                   for m in workers) >= net.nbytes + shm.nbytes  # the prefetch, and the remote read
        assert sum(value(m, "tensorcast_kv_pages_total", op="put", result="stored") for m in workers) == 2
        assert sum(value(m, "tensorcast_kv_pages_total", op="get", result="hit") for m in workers) == 2
        assert sum(value(m, "tensorcast_kv_pages_total", op="get", result="miss") for m in workers) == 1
        # The homes' own count of leases equals the store's once renewals are in step (on a busy host a home
        # may count one lapsed locally a moment before the store does): bounded by a few lease periods.
        deadline = time.monotonic() + 3 * LEASE_TTL
        while True:
            held = sum(value(scrape(urls[w]), "tensorcast_kv_shard_leases_held") for w in ("w0", "w1"))
            at_store = value(scrape(urls["gs"]), "tensorcast_gs_shard_leases_held")
            if held == at_store > 0 or time.monotonic() > deadline:
                assert held == at_store > 0, (held, at_store)
                break
            time.sleep(0.1)
        assert value(per["gs"], "tensorcast_gs_artifacts") == 2
        assert value(per["gs"], "tensorcast_rpc_served_total", method="CommitArtifact", outcome="ok") >= 2
        assert value(per["w0"], "tensorcast_rpc_sent_seconds_count", method="RegisterWorker", peer="gs") == 1
        # A refused request is counted under its error code.
        with pytest.raises(NotFound):
            local.artifact("m/absent")
        assert value(scrape(urls["gs"]), "tensorcast_rpc_served_total", method="GetArtifact",
                     outcome="NOT_FOUND") >= 1

        memory = _settled(local, cluster)
        assert sum(memory.values()) >= shm.nbytes + 2 * net.nbytes

        status = subprocess.run([sys.executable, "-m", "tensorcast", "status", "--json", "--address",
                                 cluster.address], capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        view = json.loads(status.stdout)
        assert view["metrics_urls"] == urls and view["dashboard_url"] == urls["gs"] + "/"
        assert {w["id"] for w in view["workers"]} == {"w0", "w1"}
        assert view["artifacts"]["by_prefix"] == [{"prefix": "m/", "keys": 2, "bytes": shm.nbytes + net.nbytes}]

        # A restarted worker serves its metrics at the same address (scrapers keep their targets).
        cluster.restart_worker("w1")
        assert cluster.metrics_urls["w1"] == urls["w1"]
        assert value(scrape(urls["w1"]), "tensorcast_pool_bytes", tier="memory", state="capacity") == 256 * 2**20


def _renewal_lags(url: str) -> tuple[float, float]:
    """A shard home's renewal-lag histogram: (renewals observed, those late by at most half the loop period,
    ``kv.renew_interval`` / 4). Were the lag the whole time between renewals, none would be under the period."""
    buckets = [(float(lab["le"]), v) for lab, v in
               scrape(url).get("tensorcast_kv_lease_renewal_lag_seconds_bucket", [])]
    quick = max(((le, v) for le, v in buckets if le <= RENEW_INTERVAL / 4), default=(0.0, 0.0))[1]
    return max(buckets, default=(0.0, 0.0))[1], quick


def test_plan_steps_pins_evictions_and_lease_renewals() -> None:
    mib = 2**20
    with running_cluster(workers=2, memory_capacity="16MiB", config={"worker.heartbeat_interval": HEARTBEAT}) \
            as cluster, tc.connect(cluster.address) as client:
        urls = cluster.metrics_urls
        kept = client.put({"w": np.full(mib, 1, np.uint8)}, key="p/kept", on="w0")
        plan = client.plan(ctx=tc.context(timeout=60))
        plan.pin(kept, on="w1", after=[plan.prefetch(kept, to="w1")])
        assert plan.run().result().ok
        steps = [scrape(urls[w]) for w in ("w0", "w1")]
        for op in ("prefetch", "pin"):
            assert sum(value(m, "tensorcast_plan_steps_total", op=op, outcome="succeeded") for m in steps) == 1
            assert sum(value(m, "tensorcast_plan_step_seconds_count", op=op) for m in steps) == 1
        assert sum(value(m, "tensorcast_plan_steps_total", outcome="failed") for m in steps) == 0
        assert value(scrape(urls["w1"]), "tensorcast_pool_bytes", tier="memory", state="pinned") == kept.nbytes
        assert value(scrape(urls["w0"]), "tensorcast_pool_bytes", tier="memory", state="pinned") == 0

        # Five 4 MiB cache artifacts on a 16 MiB worker: the least recently used go to make room.
        for i in range(5):
            client.put({"c": np.full(4 * mib, i + 2, np.uint8)}, key=f"p/cache{i}", on="w0")
        w0 = scrape(urls["w0"])
        assert value(w0, "tensorcast_pool_evicted_bytes_total") >= 5 * 4 * mib + kept.nbytes - 16 * mib
        assert value(w0, "tensorcast_pool_bytes", tier="memory", state="used") <= 16 * mib
        assert value(scrape(urls["w1"]), "tensorcast_pool_evicted_bytes_total") == 0  # the pinned copy stays

        # Every shard home renews its leases once a loop period; the lag is how much later than that.
        homes = [w for w in ("w0", "w1") if value(scrape(urls[w]), "tensorcast_kv_shard_leases_held") > 0]
        assert homes
        for w in homes:
            count, quick = eventually(lambda w=w: _renewal_lags(urls[w]), lambda lags: lags[1] > 0, 3 * LEASE_TTL)
            assert count >= quick > 0


def test_metrics_can_be_turned_off() -> None:
    with running_cluster(workers=1, config={"metrics.enabled": "false"}) as cluster, \
            tc.connect(cluster.address) as client:
        assert cluster.metrics_urls == {} and client.metrics_urls() == {}
        assert cluster.dashboard_url == ""


def test_metrics_need_the_cluster_token() -> None:
    with running_cluster(workers=1, token="s3cret") as cluster:
        url = cluster.metrics_urls["w0"]
        try:
            urllib.request.urlopen(url + "/metrics", timeout=10)
            raise AssertionError("metrics served without the token")
        except urllib.error.HTTPError as exc:
            assert exc.code == 401
        assert value(scrape(url, "s3cret"), "tensorcast_pool_bytes", tier="memory", state="capacity") > 0
