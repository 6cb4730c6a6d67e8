"""Shard-lease requests to a global store: malformed ones get a typed error; the table follows by deltas."""

from __future__ import annotations

import time

import pytest

import tensorcast as tc
from tensorcast.cluster import LocalCluster
from tensorcast.errors import InvalidArgument
from tensorcast.testing.cluster import wait_shards_settled
from tensorcast.wire.kv_messages import ListShards, ReleaseShards, RenewShards


def test_shards_and_tokens_must_pair_up(shared_cluster: LocalCluster) -> None:
    with tc.connect(shared_cluster.gs_address) as gs:
        for msg in (RenewShards(worker_id="w9", shards=(1, 2), tokens=(1,), ttl=1.0),
                    ReleaseShards(worker_id="w9", shards=(1,), tokens=(1, 2))):
            with pytest.raises(InvalidArgument, match="fencing tokens"):
                gs._run(gs.aio.caller.call(msg))
        assert gs._run(gs.aio.caller.call(ListShards())).num_shards > 0  # still serving


def test_the_lease_table_follows_by_deltas(shared_cluster: LocalCluster) -> None:
    with tc.connect(shared_cluster.gs_address) as gs:
        homes = {w.worker_id for w in gs.list_workers()}
        wait_shards_settled(gs, homes)
        call = gs.aio.caller.call
        full = gs._run(call(ListShards()))
        assert full.full and len(full.leases) == full.num_shards and full.epoch
        # Let every home renew every lease at least once (renewals are sent every renew_interval / 2).
        time.sleep(tc.Config.from_flat(shared_cluster.config).kv.renew_interval * 1.5)
        delta = gs._run(call(ListShards(since=full.revision, epoch=full.epoch)))
        later = {lease.shard: lease for lease in gs._run(call(ListShards())).leases}
        before = {lease.shard: lease for lease in full.leases}
        assert all(later[s].expiry > before[s].expiry for s in before)  # renewed meanwhile...
        # ...yet a delta carries only leases whose holder or token changed, or that expired: with the
        # homes settled, none. (Renewals in deltas would make each one the whole table, every tick.)
        assert not delta.full and delta.revision >= full.revision
        assert [lease for lease in delta.leases
                if (lease.holder, lease.token) == (before[lease.shard].holder, before[lease.shard].token)
                and lease.expiry > delta.now] == []
        other = gs._run(call(ListShards(since=full.revision, epoch="another-store")))
        assert other.full and len(other.leases) == other.num_shards  # another store's numbering: all of it
