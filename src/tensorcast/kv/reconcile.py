"""A shard home's lease loop as one pure decision: given what it holds, the lease table and the live homes,
which shards it steps down from (and why), gives back, renews and asks for.

Owns ``reconcile`` and the names of the reasons a home stops serving a shard. ``kv.home`` reads the table,
applies the plan (stepping down before anything is sent, so a shard is never served past the decision),
sends the releases, renewals and requests, and applies the answers. Clock values are passed in; no I/O.
Does not own: the ranking (``kv.hrw``, ``HomeLeases.plan``) or what happens to the pages (``kv.custody``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from tensorcast.kv.leases import HomeLeases, LeaseRecord

__all__ = ["EXPIRED", "OTHER_HOLDER", "OUTRANKED", "Plan", "reconcile"]

# Why a home stops serving a shard (its log says it, and tests name it).
EXPIRED = "its lease expired locally"
OTHER_HOLDER = "the global store shows another holder"
OUTRANKED = "a better-ranked shard home is alive"


@dataclass(frozen=True)
class Plan:
    step_down: tuple[tuple[int, str], ...]  # (shard, why): stop serving now
    give_back: tuple[int, ...]  # released at the store (after stepping down), their next holders told
    renew: tuple[int, ...]  # kept: renewed in one request
    acquire: tuple[int, ...]  # asked for


def reconcile(leases: HomeLeases, table: Mapping[int, LeaseRecord], homes: Sequence[str], num_shards: int,
              gs_now: float, now: float, *, grace: float, takeover: bool = True) -> Plan:
    """One loop's decisions. ``leases``: what this home holds (``now`` on its monotonic clock); ``table``: the
    lease table as followed from the store (``gs_now`` on its clock); ``homes``: the live shard homes.

    A held shard is stepped down from when its lease ran out here, or when the table shows another holder or
    token (it changed hands while this home looked away); of the rest, those a better-ranked live home should
    hold are given back, and the others renewed. Vacant shards this home ranks for are asked for
    (``HomeLeases.plan``; ``takeover=False`` just after being cut off from the store)."""
    step: list[tuple[int, str]] = []
    kept = {}
    for shard, held in sorted(leases.held.items()):
        rec = table.get(shard)
        if now >= held.local_expiry:
            step.append((shard, EXPIRED))
        elif rec is None or rec.holder != leases.worker_id or rec.token != held.token:
            step.append((shard, OTHER_HOLDER))
        else:
            kept[shard] = held
    acquire, give_back = replace(leases, held=kept).plan(table, homes, num_shards, gs_now, grace=grace,
                                                          takeover=takeover)
    back = set(give_back)
    return Plan(tuple(step), tuple(sorted(back)), tuple(s for s in sorted(kept) if s not in back),
                tuple(sorted(acquire)))
