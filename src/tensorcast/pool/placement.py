"""Placement policies: where an artifact lives and what happens when memory is full.

Owns: the general form (``Placement``), the named presets users know from other tensor stores, and
validation with clear errors. Pure: no I/O. The worker applies a placement in ``worker.puts``.

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

from typing import Literal

import msgspec

from tensorcast.errors import InvalidArgument

__all__ = ["PRESETS", "Placement", "resolve_placement"]

Need = Literal["required", "preferred", "none"]
Overflow = Literal["evict", "spill", "reject"]


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    """General placement. ``overflow``: what a put does when memory is full — ``evict`` least-recently
    used evictable replicas, ``spill`` to the disk tier only, ``reject`` with ``ResourceExhausted``."""

    name: str = "custom"
    memory: Need = "preferred"
    disk: Literal["required", "none"] = "none"
    replicas: int = 1
    overflow: Overflow = "evict"
    evictable: bool = True
    # Drop the memory copy this many seconds after the put (the disk copy stays). None: keep.
    memory_ttl: float | None = None

    def validate(self) -> Placement:
        if self.memory not in ("required", "preferred", "none"):
            raise InvalidArgument(f"placement.memory must be required/preferred/none, got {self.memory!r}")
        if self.disk not in ("required", "none"):
            raise InvalidArgument(f"placement.disk must be required/none, got {self.disk!r}")
        if self.overflow not in ("evict", "spill", "reject"):
            raise InvalidArgument(f"placement.overflow must be evict/spill/reject, got {self.overflow!r}")
        if self.memory == "none" and self.disk == "none":
            raise InvalidArgument("placement keeps no copy: memory and disk are both 'none'")
        if not 1 <= self.replicas <= 16:
            raise InvalidArgument(f"placement.replicas must be 1..16, got {self.replicas}")
        if self.replicas > 1 and self.memory == "none":
            raise InvalidArgument("extra replicas are memory replicas: memory may not be 'none'")
        if self.overflow == "spill" and self.memory == "required":
            raise InvalidArgument("overflow 'spill' contradicts memory 'required'")
        if self.memory_ttl is not None and (self.memory_ttl <= 0 or self.disk != "required"):
            raise InvalidArgument("memory_ttl needs a positive value and disk 'required'")
        return self

    @property
    def wants_memory(self) -> bool:
        return self.memory != "none"


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
            raise InvalidArgument(f"unknown placement policy {policy!r}; presets: {', '.join(PRESETS)} "
                                  "(or pass a tensorcast.Placement)") from None
        if p.name == "cold" and cold_memory_ttl is not None:
            p = msgspec.structs.replace(p, memory_ttl=cold_memory_ttl)
        return p
    raise InvalidArgument(f"policy must be a preset name or a Placement, got {type(policy).__name__}")
