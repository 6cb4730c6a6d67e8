"""When the KV shard table has settled (pure): every shard held, unexpired, by its HRW home.

Owns the rule ``LocalCluster.start()`` (and so ``tensorcast up``) and ``add_worker`` wait for before they
return, so that pages put right after them land on the homes that keep them. The live shard homes are the
workers with the ``shard-home`` role whose last heartbeat is within ``lease_ttl`` of the table's clock (as the
homes themselves count them, ``kv.home``); a shard is settled when its lease has a holder, has not expired at
the table's ``now``, and that holder is the rank-0 HRW candidate of the shard among the live homes
(``kv.hrw.candidates``). Does not own: reading the table or waiting (``cluster``), or moving shards
(``kv.home``, ``kv.leases``).
"""

from __future__ import annotations

from collections.abc import Iterable

from tensorcast.kv.hrw import candidates
from tensorcast.records import ShardLease, WorkerInfo

__all__ = ["live_homes", "settled", "unsettled"]


def live_homes(workers: Iterable[WorkerInfo], now: float, lease_ttl: float) -> list[str]:
    """The shard homes heartbeating within ``lease_ttl`` of ``now`` (the global store's clock), sorted."""
    return sorted(w.worker_id for w in workers if "shard-home" in w.roles and now - w.last_heartbeat < lease_ttl)


def unsettled(num_shards: int, leases: Iterable[ShardLease], homes: list[str], now: float) -> list[int]:
    """The shards not (yet) held, unexpired, by their rank-0 candidate among ``homes``; every shard when there
    is no home."""
    held = {lease.shard: lease for lease in leases}
    out = []
    for shard in range(num_shards):
        lease = held.get(shard)
        if (lease is None or not lease.holder or lease.expiry <= now or not homes
                or lease.holder != candidates(shard, homes, 1)[0]):
            out.append(shard)
    return out


def settled(num_shards: int, leases: Iterable[ShardLease], workers: Iterable[WorkerInfo], now: float,
            lease_ttl: float) -> bool:
    """Whether every shard is held by its rank-0 live home (see the module's docstring)."""
    return not unsettled(num_shards, leases, live_homes(workers, now, lease_ttl), now)
