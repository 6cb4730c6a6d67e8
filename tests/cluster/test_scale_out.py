"""A cluster's size over its life, with real processes: ``start()`` returns once the KV shard table has settled
(pages put at once stay readable), ``add_worker()`` joins one more worker that serves puts, gets and its share
of the shards, and ``stop_worker()`` stops one gracefully."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

import tensorcast as tc
from tensorcast.errors import InvalidArgument
from tensorcast.kv.hrw import assignment
from tensorcast.kv.keys import KVLayout, page_keys
from tensorcast.testing import running_cluster

LAYOUT = KVLayout("scale-model", layers=2, kv_heads=2, head_dim=16, dtype="float16", page_size=16)
TTL, RENEW = 2.0, 0.5
KV_CONFIG = {"kv.lease_ttl": TTL, "kv.renew_interval": RENEW, "worker.prefault_bytes": 0}


def _pages(n: int, seed: int) -> tuple[list[str], list[np.ndarray]]:
    keys = page_keys([seed * 100_003 + i for i in range(n * LAYOUT.page_size)], LAYOUT)
    rng = np.random.default_rng(seed)
    return keys, [rng.integers(0, 255, LAYOUT.page_bytes, dtype=np.uint8) for _ in keys]


def _readable(client: tc.Client, keys: list[str], pages: list[np.ndarray]) -> int:
    got = client.kv.get(keys)
    return sum(g is not None and np.array_equal(g, p) for g, p in zip(got, pages, strict=True))


def _holders(client: tc.Client) -> dict[int, str]:
    table = client.list_shards()
    return {lease.shard: lease.holder for lease in table.leases if lease.holder and lease.expiry > table.now}


def test_pages_put_right_after_start_stay_readable() -> None:
    """With the default lease timing, as a user starts a cluster: about half the pages were lost when start()
    returned while shards still moved to their homes."""
    kv = tc.Config().kv
    with running_cluster(workers=3, config={"worker.prefault_bytes": 0}) as cluster, \
            tc.connect(cluster.address) as client:
        # start() returned with every shard on its HRW home: nothing moves (and drops pages) from here on.
        assert _holders(client) == assignment(client.list_shards().num_shards, cluster.worker_ids)
        keys, pages = _pages(1000, seed=1)
        assert client.kv.put(keys, pages, layout=LAYOUT) == len(keys)
        time.sleep(2 * (kv.lease_ttl + kv.renew_interval))  # longer than any shard would take to move
        assert _readable(client, keys, pages) == len(keys)


def test_add_worker_joins_serves_and_stops_cleanly() -> None:
    with running_cluster(workers=2, config=KV_CONFIG) as cluster, tc.connect(cluster.address) as client:
        wid = cluster.add_worker()
        assert wid == "w2" and cluster.worker_ids == ["w0", "w1", "w2"]
        handle = cluster.workers["w2"]
        workers = {w.worker_id: w for w in client.list_workers()}
        assert workers["w2"].alive and workers["w2"].pid == handle.pid
        manifest = json.loads((cluster.data_dir / "cluster.json").read_text())
        assert manifest["workers"]["w2"] == {"address": handle.address, "pid": handle.pid}
        # It returned with the shard table settled on the three homes: w2 holds its share already.
        num_shards = client.list_shards().num_shards
        want = assignment(num_shards, cluster.worker_ids)
        assert _holders(client) == want and "w2" in want.values()
        # Puts and gets through it (as a gateway, into its memory) and KV pages on its shards.
        x = np.arange(1 << 14, dtype=np.float32)
        with tc.connect(handle.address) as via:
            art = via.put({"x": x}, key="scale/x", on="w2")
            assert "w2" in {r.worker_id for r in art.replicas}
            keys, pages = _pages(200, seed=2)
            assert via.kv.put(keys, pages, layout=LAYOUT) == len(keys)
        assert np.array_equal(client.artifact("scale/x").tensor("x", like="numpy"), x)
        assert _readable(client, keys, pages) == len(keys)

        assert cluster.stop_worker("w2") == 0  # SIGTERM: it drained and exited by itself
        assert handle.popen is not None and handle.popen.returncode == 0
        assert cluster.worker_ids == ["w0", "w1"]
        assert "w2" not in json.loads((cluster.data_dir / "cluster.json").read_text())["workers"]
        assert _holders(client) == assignment(num_shards, ["w0", "w1"])  # settled on the remaining homes


def test_add_and_stop_worker_refuse_what_cannot_be_done() -> None:
    with running_cluster(workers=1, config=KV_CONFIG) as cluster:
        with pytest.raises(InvalidArgument, match="taken"):
            cluster.add_worker("w0")
        with pytest.raises(InvalidArgument, match="host"):
            cluster.add_worker(host=1)
        with pytest.raises(InvalidArgument, match="last worker"):
            cluster.stop_worker("w0")
        with pytest.raises(InvalidArgument, match="no worker"):
            cluster.stop_worker("w9")
        assert cluster.workers["w0"].alive()
