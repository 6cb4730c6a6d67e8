"""The global store's storage-backend interface and the pure rules every backend applies.

Owns: ``MetadataBackend`` (what the GS service needs from a database, in domain terms: workers,
artifacts, keys, replicas, pending drops) and the lease-merging rule. A backend commits durably before
its coroutine returns, so the service acknowledges only what is on disk. Does not own: SQL (``gs.sqlite``)
or the RPC surface (``gs.service``). A later backend (etcd) implements the same class.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tensorcast.kv.leases import LeaseRecord
from tensorcast.records import ArtifactInfo, InstanceInfo, WorkerInfo

__all__ = ["ArtifactRow", "MetadataBackend", "merge_lease"]


@dataclass(frozen=True, slots=True)
class ArtifactRow:
    """An artifact's durable record (identity + ownership); replicas and keys are joined on read."""

    info: ArtifactInfo  # tensors, nbytes, created_at; keys/replicas empty
    lease_expiry: float | None  # None: system-owned


def merge_lease(existing: float | bool | None, new: float | None) -> float | None:
    """Ownership after a put of an artifact that may already exist.

    ``existing`` is False when the artifact is new. System ownership (None) always wins: a caller lease
    never downgrades a system-owned artifact, and a system-owned put upgrades a leased one. Two leases
    keep the later expiry.
    """
    if existing is False:
        return new
    if existing is None or new is None:
        return None
    assert isinstance(existing, float)
    return max(existing, new)


class MetadataBackend(abc.ABC):
    @abc.abstractmethod
    async def open(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    async def check(self) -> None:
        """``Unavailable`` when the metadata cannot be read and written right now (a readiness probe)."""

    # ----------------------------------------------------------------- workers
    @abc.abstractmethod
    async def register_worker(self, worker: WorkerInfo, now: float) -> tuple[int, list[str]]:
        """Insert or replace a worker; bump and return its incarnation, and the artifacts left with no
        replica at all. Its memory replicas (from a previous incarnation) are removed: memory does not
        survive a restart. Its pending drops stay (it still holds the disk copies it must drop)."""

    @abc.abstractmethod
    async def heartbeat(self, worker_id: str, incarnation: int, stats: dict[str, float], now: float,
                        dropped: tuple[str, ...]) -> tuple[bool, tuple[str, ...]]:
        """Record liveness and usage; acknowledge dropped artifacts. Returns (known, to_drop)."""

    @abc.abstractmethod
    async def list_workers(self) -> list[WorkerInfo]: ...

    @abc.abstractmethod
    async def get_worker(self, worker_id: str) -> WorkerInfo | None: ...

    # ----------------------------------------------------------------- instances
    @abc.abstractmethod
    async def upsert_instance(self, info: InstanceInfo, now: float) -> None: ...

    @abc.abstractmethod
    async def instance_heartbeat(self, instance_id: str, load: dict[str, int], now: float) -> bool:
        """Record an instance's load; False if the instance is unknown (it must register again)."""

    @abc.abstractmethod
    async def list_instances(self) -> list[InstanceInfo]: ...

    # ----------------------------------------------------------------- shard leases
    @abc.abstractmethod
    async def load_leases(self) -> dict[int, LeaseRecord]:
        """The shard lease table (as current as this process knows it: other global stores' changes arrive
        by watch)."""

    @abc.abstractmethod
    async def update_leases(self, shards: Sequence[int],
                            change: Callable[[int, LeaseRecord | None], LeaseRecord | None]) -> list[LeaseRecord]:
        """For each shard, atomically: read its record, ``change(shard, record)`` it (None: leave it), and
        write the result only if nobody changed the record meanwhile (else read it again and decide again).
        Durable before it returns the records that changed: two global stores granting the same shard at
        once cannot both win, and a fencing token never goes back."""

    # ----------------------------------------------------------------- the global stores themselves
    @abc.abstractmethod
    async def announce_store(self, address: str, metrics_url: str, ttl: float) -> None:
        """A global-store process serving at ``address`` is alive (called well within ``ttl``; an entry not
        announced again within it is gone)."""

    @abc.abstractmethod
    async def list_stores(self, now: float) -> dict[str, str]:
        """The live global-store processes: address -> metrics URL ("" when metrics are off)."""

    @abc.abstractmethod
    async def page_index_put(self, keys: tuple[str, ...], worker_id: str) -> None:
        """Benchmark switch only: per-page locations in the store (what shard homes exist to avoid)."""

    @abc.abstractmethod
    async def page_index_get(self, keys: tuple[str, ...]) -> list[str]: ...

    # ----------------------------------------------------------------- artifacts
    @abc.abstractmethod
    async def commit_artifact(self, info: ArtifactInfo, worker_id: str, key: str | None,
                              lease_expiry: float | None, now: float, tiers: tuple[str, ...] = ("memory",),
                              restored: bool = False) -> bool:
        """Atomically: record the artifact if new (ownership merged with ``merge_lease``; a tombstone of it is
        cleared), point ``key`` at it (moving the key if it existed), and record ``worker_id``'s replicas in
        ``tiers``. ``restored``: a copy announced after the worker restarted — refused (False, nothing
        changes) when the artifact was deleted meanwhile (a tombstone, or a drop this worker owes)."""

    @abc.abstractmethod
    async def resolve_key(self, key: str) -> str | None: ...

    @abc.abstractmethod
    async def get_artifact(self, artifact_id: str) -> ArtifactRow | None: ...

    @abc.abstractmethod
    async def keys_of(self, artifact_id: str) -> tuple[str, ...]: ...

    @abc.abstractmethod
    async def replicas_of(self, artifact_id: str) -> list[tuple[str, str]]:
        """(worker_id, tier) pairs."""

    @abc.abstractmethod
    async def list_artifacts(self, prefix: str, limit: int, after: str = "") -> tuple[list[str], str]:
        """One page: ids of artifacts with a key starting with ``prefix`` (all artifacts, by id, when it is
        empty), after the cursor ``after``; and the cursor of the next page ("" after the last)."""

    @abc.abstractmethod
    async def key_sizes(self, limit: int) -> tuple[list[tuple[str, int]], int]:
        """Up to ``limit`` (key, artifact bytes) pairs in key order, and how many artifacts exist (the
        dashboard's artifacts by key prefix)."""

    @abc.abstractmethod
    async def set_lease(self, artifact_id: str, lease_expiry: float | None) -> bool: ...

    @abc.abstractmethod
    async def delete_artifact(self, artifact_id: str, now: float, reason: str = "deleted") -> list[str]:
        """Remove the record and its keys; its replicas become pending drops; a tombstone (of the id and of
        its keys) remembers why. Returns holder ids."""

    @abc.abstractmethod
    async def tombstone(self, key_or_id: str) -> tuple[str, str] | None:
        """(artifact id, reason) of a deleted artifact, by id or by a key it had; None if there is none."""

    @abc.abstractmethod
    async def prune_tombstones(self, before: float) -> int:
        """Forget tombstones older than ``before``; returns how many."""

    @abc.abstractmethod
    async def expired_artifacts(self, now: float) -> list[str]: ...

    @abc.abstractmethod
    async def add_replica(self, artifact_id: str, worker_id: str, tiers: tuple[str, ...],
                          restored: bool = False) -> bool:
        """Record replicas of an existing artifact; False if the artifact is unknown, or (``restored``: a
        copy announced after a restart) if this worker owes a drop of it."""

    @abc.abstractmethod
    async def remove_replica(self, artifact_id: str, worker_id: str, tier: str) -> bool:
        """Forget a replica; True when the artifact (still recorded) has no replica left."""
