"""Placement policies: where an artifact lives and what happens when memory is full.

Owns: the named presets users know from other tensor stores (the general form, ``Placement``, is a record), and
the decisions a placement implies: where a put lands (``decide_put``: memory after evicting whom, the disk tier,
or a refusal; ``admit_digests_later``: whether a put may send its digests last), which workers receive its
further copies (``replica_candidates``, ``replica_targets``), and which copies restore artifacts that lost some
(``plan_repairs``). Pure: no I/O, no clock (``now`` is passed in). The worker applies the decisions
(``worker.puts``, ``worker.replication``).

| preset    | memory    | disk     | replicas | on memory overflow          | evictable |
|-----------|-----------|----------|----------|-----------------------------|-----------|
| cache     | preferred | -        | 1        | evict LRU, else refuse      | yes       |
| durable   | preferred | required | 1        | evict LRU, else disk only   | yes       |
| ha        | preferred | required | 2        | evict LRU, else disk only   | yes       |
| cold      | preferred | required | 1        | disk only; memory copy dropped after ``memory_ttl`` | yes |
| warm      | required  | -        | 1        | refuse (ResourceExhausted)  | yes       |
| pinned    | required  | -        | 1        | refuse (ResourceExhausted)  | no        |

``replicas`` counts copies on distinct live workers (``ArtifactInfo.copies``; a worker's copy is its memory
replica, or its disk one): the first where the put lands, the others copied worker-to-worker before ``put``
returns (a target that fails is replaced by the next candidate), as many as live workers allow within the
put's deadline; ``ArtifactInfo.replicas_wanted`` keeps the count, and a worker's loss (or an evicted copy)
starts new copies elsewhere. A ``durable``/``ha``/``cold`` artifact is never lost while its disk copy exists:
eviction only ever drops memory copies.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

import msgspec

from tensorcast.errors import InvalidArgument, ResourceExhausted, clip
from tensorcast.pool.state import PoolState
from tensorcast.records import ArtifactInfo, Placement, WorkerInfo

__all__ = ["PRESETS", "Placement", "PutDecision", "Repair", "admit_digests_later", "decide_put", "plan_repairs",
           "replica_candidates", "replica_targets", "resolve_placement"]


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


def admit_digests_later(placement: Placement, state: PoolState, need: int, high_watermark: float) -> bool:
    """Whether a worker takes a same-host put whose digests come with its commit (``digests_later``), needing
    ``need`` bytes of memory for tensors it cannot yet tell apart from blobs it holds. No: the put would make
    room (evict now, spill to disk, or push the memory tier above ``high_watermark`` of its capacity, which
    the housekeeping then evicts down from) for bytes the worker may hold already, and with the digests first
    those bytes need no room at all; the worker answers ``digests_first`` and the caller hashes before it
    writes (``client.put_path``)."""
    if not placement.wants_memory or need > state.free:
        return False
    return state.used + state.reserved + need <= high_watermark * state.capacity


def replica_targets(workers: Iterable[WorkerInfo], self_id: str, self_host: str, extra: int) -> list[str]:
    """The ``extra`` live workers that take further copies of a fresh artifact held by ``self_id`` only."""
    return replica_candidates(workers, {self_id: self_host})[:max(extra, 0)]


def replica_candidates(workers: Iterable[WorkerInfo], holders: Mapping[str, str],
                       planned: Mapping[str, int] | None = None) -> list[str]:
    """The live workers that may take a further copy of an artifact held by ``holders`` (worker id -> host),
    best first: on the hosts with the fewest copies so far (a host failure then loses fewer; each pick counts
    for the next, so two copies to place on three hosts go to two hosts), then the least full (counting the
    bytes ``planned`` for them already), then by id."""
    planned = planned or {}
    on_host = Counter(holders.values())
    free = [w for w in workers if w.alive and w.worker_id not in holders]
    out: list[str] = []
    while free:
        best = min(free, key=lambda w: (on_host[w.host_id], (w.memory_used + planned.get(w.worker_id, 0)) /
                                        max(w.memory_capacity, 1), w.worker_id))
        out.append(best.worker_id)
        on_host[best.host_id] += 1
        free.remove(best)
    return out


@dataclass(frozen=True, slots=True)
class Repair:
    """One copy to make: ``source`` (the holder responsible for it) has ``target`` pull the artifact."""

    artifact_id: str
    source: str
    target: str


def plan_repairs(artifacts: Iterable[ArtifactInfo], workers: Iterable[WorkerInfo], now: float, *,
                 busy: Collection[str] = (), avoid: Mapping[tuple[str, str], float] | None = None) -> list[Repair]:
    """The copies that bring each artifact back to ``replicas_wanted`` copies on distinct live workers.

    Each short artifact's copies are made by its live holder with the lowest id (every holder decides the
    same without talking to the others), onto ``replica_candidates`` of its live holders (each planned copy
    counts for the next artifact's choice); never onto a pair in ``avoid`` (artifact, target) until the time
    it maps to (a copy there failed). Artifacts in ``busy`` (copies already being made) and those with no
    live holder (nothing to copy from) get none."""
    avoid = avoid or {}
    workers = list(workers)
    host_of = {w.worker_id: w.host_id for w in workers}
    alive = {w.worker_id for w in workers if w.alive}
    planned: Counter[str] = Counter()
    out: list[Repair] = []
    for info in sorted(artifacts, key=lambda a: a.id):
        live = sorted({r.worker_id for r in info.replicas if r.worker_id in alive})
        need = info.replicas_wanted - len(live)
        if need <= 0 or not live or info.id in busy:
            continue
        holders = {wid: host_of[wid] for wid in live}
        targets = [t for t in replica_candidates(workers, holders, planned) if avoid.get((info.id, t), 0.0) <= now]
        for target in targets[:need]:
            out.append(Repair(info.id, live[0], target))
            planned[target] += info.nbytes
    return out
