"""Shard-lease requests to a global store: malformed ones get a typed error; the table follows by deltas."""

from __future__ import annotations

import pytest

import tensorcast as tc
from tensorcast.cluster import LocalCluster
from tensorcast.errors import InvalidArgument
from tensorcast.wire.kv_messages import ListShards, ReleaseShards, RenewShards, ShardGrants, ShardTable


def test_shards_and_tokens_must_pair_up(shared_cluster: LocalCluster) -> None:
    with tc.connect(shared_cluster.gs_address) as gs:
        for msg in (RenewShards(worker_id="w9", shards=(1, 2), tokens=(1,), ttl=1.0),
                    ReleaseShards(worker_id="w9", shards=(1,), tokens=(1, 2))):
            with pytest.raises(InvalidArgument, match="fencing tokens"):
                gs._run(gs.aio.caller.call(msg, ShardGrants))
        assert gs._run(gs.aio.caller.call(ListShards(), ShardTable)).num_shards > 0  # still serving


def test_the_lease_table_follows_by_deltas(shared_cluster: LocalCluster) -> None:
    with tc.connect(shared_cluster.gs_address) as gs:
        full = gs._run(gs.aio.caller.call(ListShards(), ShardTable))
        assert full.full and len(full.leases) == full.num_shards and full.epoch
        delta = gs._run(gs.aio.caller.call(ListShards(since=full.revision, epoch=full.epoch), ShardTable))
        assert not delta.full and delta.revision >= full.revision
        # Only renewals since then (expiry moved) can be in it, never more than the table.
        assert len(delta.leases) <= full.num_shards
        assert all(lease.expiry >= {x.shard: x for x in full.leases}[lease.shard].expiry for lease in delta.leases)
        other = gs._run(gs.aio.caller.call(ListShards(since=full.revision, epoch="another-store"), ShardTable))
        assert other.full and len(other.leases) == other.num_shards  # another store's numbering: all of it
