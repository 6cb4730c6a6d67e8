"""The one replica ranking both readers use (a caller's and a worker pulling from peers), table-driven."""

from __future__ import annotations

import pytest

from tensorcast.errors import InvalidArgument
from tensorcast.pool.sources import SOURCES, rank_sources
from tensorcast.records import ReplicaInfo

# Named for where they are from host "h0": local/remote, memory/disk.
REPLICAS = [ReplicaInfo(worker_id="remote-disk", host_id="h1", tier="disk"),
            ReplicaInfo(worker_id="remote-mem", host_id="h1"),
            ReplicaInfo(worker_id="local-disk", host_id="h0", tier="disk"),
            ReplicaInfo(worker_id="local-mem", host_id="h0"),
            ReplicaInfo(worker_id="remote-mem-2", host_id="h2")]


@pytest.mark.parametrize("source, order", [
    ("auto", ["local-mem", "local-disk", "remote-mem", "remote-mem-2", "remote-disk"]),
    ("prefer_p2p", ["local-mem", "remote-mem", "remote-mem-2", "local-disk", "remote-disk"]),
    ("prefer_disk", ["local-disk", "remote-disk", "local-mem", "remote-mem", "remote-mem-2"]),
    ("local_only", ["local-mem", "local-disk"]),
])
def test_each_preference_orders_the_replicas(source: str, order: list[str]) -> None:
    assert [r.worker_id for r in rank_sources(REPLICAS, "h0", source)] == order


def test_every_named_preference_is_ranked_and_others_are_refused() -> None:
    assert all(rank_sources(REPLICAS, "h0", s) for s in SOURCES)
    with pytest.raises(InvalidArgument, match="source must be one of"):
        rank_sources(REPLICAS, "h0", "fastest")


def test_a_reader_with_no_host_ranks_every_replica_as_remote() -> None:
    assert [r.worker_id for r in rank_sources(REPLICAS, "h9")] == ["remote-mem", "local-mem", "remote-mem-2",
                                                                   "remote-disk", "local-disk"]
