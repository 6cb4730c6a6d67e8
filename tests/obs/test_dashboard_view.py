"""The dashboard's view, built from hand-made records (no processes)."""

from __future__ import annotations

from tensorcast.obs.dashboard import cluster_view, key_prefix
from tensorcast.records import InstanceInfo, ShardLease, WorkerInfo


def test_key_prefix() -> None:
    assert key_prefix("demo/model@v1") == "demo/"
    assert key_prefix("qwen@v3") == "qwen@"
    assert key_prefix("plain") == "plain"


def test_cluster_view_totals_leases_and_prefixes() -> None:
    workers = [
        WorkerInfo(worker_id="w0", address="a", host_id="h", roles=("basic",), memory_used=300,
                   memory_capacity=1000, net_in_bps=10.0, net_out_bps=5.0, transfers_in_flight=2,
                   plans_in_flight=1, artifacts=3),
        WorkerInfo(worker_id="w1", address="b", host_id="h", roles=("basic",), memory_used=700,
                   memory_capacity=1000, net_in_bps=1.0, alive=True),
        WorkerInfo(worker_id="w2", address="c", host_id="h", roles=("basic",), memory_used=999,
                   memory_capacity=1000, alive=False),  # dead: not in the totals
    ]
    instances = [InstanceInfo(instance_id="i0", address="x", home_worker="w0", running=3, waiting=2),
                 InstanceInfo(instance_id="i1", address="y", home_worker="w1", running=9, alive=False)]
    leases = [ShardLease(shard=0, holder="w0", token=4, expiry=110.0),
              ShardLease(shard=1, holder="w0", token=7, expiry=120.0),
              ShardLease(shard=2, holder="w1", token=1, expiry=99.0),  # expired at now=100
              ShardLease(shard=3, holder="", token=2, expiry=0.0)]
    keys = [("demo/a@v1", 100), ("demo/b@v1", 50), ("qwen@v1", 1000), ("qwen@v2", 1000)]
    view = cluster_view(workers, instances, 8, leases, keys, 5, now=100.0)
    t = view["totals"]
    assert (t["workers"], t["workers_alive"], t["memory_used"], t["memory_capacity"]) == (3, 2, 1000, 2000)
    assert (t["net_in_bps"], t["transfers_in_flight"], t["plans_in_flight"], t["load"]) == (11.0, 2, 1, 5)
    assert view["workers"][1]["memory_pressure"] == 0.7
    assert view["shards"] == {"num_shards": 8, "held": 2, "vacant": 6,
                              "by_holder": [{"holder": "w0", "shards": 2, "max_token": 7}]}
    assert view["artifacts"] == {"total": 5, "by_prefix": [{"prefix": "qwen@", "keys": 2, "bytes": 2000},
                                                           {"prefix": "demo/", "keys": 2, "bytes": 150}]}
    assert [i["load"] for i in view["instances"]] == [5, 9]
