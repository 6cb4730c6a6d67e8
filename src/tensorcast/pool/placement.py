"""Placement policies: where an artifact lives and what happens when memory is full.

Owns: the named presets users know from other tensor stores (the general form, ``Placement``, is a
record), and the decisions a placement implies: where a put lands (``decide_put``: memory after evicting
whom, the disk tier, or a refusal) and which workers receive its extra replicas (``replica_targets``).
Pure: no I/O, no clock (``now`` is passed in). The worker applies the decisions in ``worker.puts``.

| preset    | memory    | disk     | replicas | on memory overflow          | evictable |
|-----------|-----------|----------|----------|-----------------------------|-----------|
| cache     | preferred | -        | 1        | evict LRU, else refuse      | yes       |
| durable   | preferred | required | 1        | evict LRU, else disk only   | yes       |
| ha        | preferred | required | 2        | evict LRU, else disk only   | yes       |
| cold      | preferred | required | 1        | disk only; memory copy dropped after ``memory_ttl`` | yes |
| warm      | required  | -        | 1        | refuse (ResourceExhausted)  | yes       |
| pinned    | required  | -        | 1        | refuse (ResourceExhausted)  | no        |

``replicas`` counts memory replicas on distinct workers (the first where the put lands, the others
copied worker-to-worker before ``put`` returns, when such workers exist). A ``durable``/``ha``/``cold``
artifact is never lost while its disk copy exists: eviction only ever drops memory copies.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from tensorcast.errors import InvalidArgument, ResourceExhausted, clip
from tensorcast.pool.state import PoolState
from tensorcast.records import Placement, WorkerInfo

__all__ = ["PRESETS", "Placement", "PutDecision", "decide_put", "replica_targets", "resolve_placement"]


PRESETS: dict[str, Placement] = {
    "cache": Placement(name="cache", memory="preferred", overflow="evict"),
    "durable": Placement(name="durable", memory="preferred", disk="required", overflow="evict"),
    "ha": Placement(name="ha", memory="preferred", disk="required", replicas=2, overflow="evict"),
    "cold": Placement(name="cold", memory="preferred", disk="required", overflow="spill", memory_ttl=60.0),
    "warm": Placement(name="warm", memory="required", overflow="reject"),
    "pinned": Placement(name="pinned", memory="required", overflow="reject", evictable=False),
}


def resolve_placement(policy: str | Placement | None, cold_memory_ttl: float | None = None) -> Placement:
    """A preset name or a ``Placement`` -> a validated ``Placement`` (``None`` = ``cache``)."""
    if policy is None:
        return PRESETS["cache"]
    if isinstance(policy, Placement):
        return policy.validate()
    if isinstance(policy, str):
        try:
            p = PRESETS[policy]
        except KeyError:
            raise InvalidArgument(f"unknown placement policy {clip(policy)}; presets: {', '.join(PRESETS)} "
                                  "(or pass a tensorcast.Placement)") from None
        if p.name == "cold" and cold_memory_ttl is not None:
            p = msgspec.structs.replace(p, memory_ttl=cold_memory_ttl)
        return p
    raise InvalidArgument(f"policy must be a preset name or a Placement, got {type(policy).__name__}")


@dataclass(frozen=True, slots=True)
class PutDecision:
    """Where a put's bytes go: memory (after evicting ``evict``, least recently used first), the disk tier,
    both, or neither (every copy the placement wants is already here)."""

    to_memory: bool
    to_disk: bool
    evict: tuple[str, ...] = ()


def decide_put(placement: Placement, state: PoolState, need: int, now: float, present: Iterable[str], *,
               has_disk: bool, exclude: frozenset[str] = frozenset()) -> PutDecision:
    """Apply ``placement`` to a put needing ``need`` bytes of new memory on a worker whose memory tier is
    ``state`` and which already holds the artifact in the tiers ``present``.

    Raises ``ResourceExhausted`` when memory is full and the placement may neither evict enough nor spill,
    and ``InvalidArgument`` when it needs a disk tier this worker lacks. Nothing changes either way."""
    present = set(present)
    want_disk = placement.disk == "required"
    if want_disk and not has_disk:
        raise InvalidArgument("this worker has no disk tier (worker.disk_dir is not set)")
    to_disk = want_disk and "disk" not in present
    if not placement.wants_memory or "memory" in present:
        return PutDecision(False, to_disk)
    if need <= state.free:
        return PutDecision(True, to_disk)
    may_spill = placement.memory != "required" and (want_disk or placement.overflow == "spill")
    if placement.overflow == "evict":
        try:
            return PutDecision(True, to_disk, tuple(state.victims(need, now, exclude)))
        except ResourceExhausted:
            if not may_spill:
                raise
    elif not may_spill:
        raise ResourceExhausted(f"memory tier full ({max(state.free, 0)} of {state.capacity} bytes free) and "
                                f"placement {clip(placement.name)} may not evict or spill")
    if not has_disk:
        raise InvalidArgument("memory is full and spilling needs a disk tier (worker.disk_dir is not set)")
    return PutDecision(False, "disk" not in present)


def replica_targets(workers: Iterable[WorkerInfo], self_id: str, self_host: str, extra: int) -> list[str]:
    """The ``extra`` live workers that take further memory replicas of a fresh artifact: other hosts first
    (a host failure then loses fewer copies), then the least full."""
    others = sorted((w for w in workers if w.alive and w.worker_id != self_id),
                    key=lambda w: (w.host_id == self_host, w.memory_used / max(w.memory_capacity, 1), w.worker_id))
    return [w.worker_id for w in others[:max(extra, 0)]]
