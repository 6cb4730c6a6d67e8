"""The global store's storage-backend interface.

Owns: ``MetadataBackend`` (what the GS service needs from a database, in domain terms: workers,
artifacts, their references (key bindings and the anonymous hold or lease), replicas, pending drops) and the
records it returns. A backend commits durably before its coroutine returns, so the service acknowledges only
what is on disk. Does not own: the reference rules (``gs.refs``), SQL (``gs.sqlite``), etcd (``gs.etcd``) or
the RPC surface (``gs.service``).
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tensorcast.gs.refs import References, merge_lease
from tensorcast.kv.leases import LeaseRecord
from tensorcast.records import ArtifactInfo, InstanceInfo, WorkerInfo, WorkerLoad

__all__ = ["ArtifactCommit", "ArtifactRow", "GoalRow", "MetadataBackend", "Unbound", "merge_lease"]

# An artifact wanting more than one copy: (id, wanted copies, its (worker, tier) replicas).
GoalRow = tuple[str, int, list[tuple[str, str]]]


@dataclass(frozen=True, slots=True)
class ArtifactRow:
    """An artifact's durable record (identity) and its references; replicas are joined on read."""

    info: ArtifactInfo  # tensors, nbytes, created_at; keys/replicas empty
    refs: References


@dataclass(frozen=True, slots=True)
class ArtifactCommit:
    """One commit of a group (``MetadataBackend.commit_artifacts``): ``commit_artifact``'s arguments."""

    info: ArtifactInfo
    worker_id: str
    key: str | None
    lease_expiry: float | None
    tiers: tuple[str, ...] = ("memory",)
    restored: bool = False


@dataclass(frozen=True, slots=True)
class Unbound:
    """What removing one reference did: ``removed`` (nothing kept the artifact: it was deleted, its
    ``holders`` owe drops) or not (``keys``: the live keys still naming it)."""

    removed: bool
    holders: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()


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
    async def heartbeat(self, worker_id: str, incarnation: int, load: WorkerLoad, now: float,
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
        """Atomically: record the artifact if new (a tombstone of it is cleared), add the put's reference —
        the binding of ``key``, or the anonymous reference when ``key`` is None — merged with ``merge_lease``
        onto the one there (``lease_expiry`` None: permanent), and record ``worker_id``'s replicas in
        ``tiers``. A key bound to another artifact moves: that artifact keeps what the key held as its
        anonymous reference (merged), so it stays reachable by id as before. ``restored``: a copy announced
        after the worker restarted — refused (False, nothing changes) when the artifact was deleted meanwhile
        (a tombstone, or a drop this worker owes)."""

    async def commit_artifacts(self, commits: Sequence[ArtifactCommit], now: float) -> list[bool]:
        """``commit_artifact`` of each (a group commit); a backend that can records them all in one
        transaction, durable once if any of them needs it. An error fails the group: none of them may be taken
        as recorded. Here, each its own transaction, all at once (as many single commits in flight would be),
        the first error raised once all are done."""
        done = await asyncio.gather(*(self.commit_artifact(c.info, c.worker_id, c.key, c.lease_expiry, now, c.tiers,
                                                           c.restored) for c in commits), return_exceptions=True)
        for outcome in done:
            if isinstance(outcome, BaseException):
                raise outcome
        return [bool(d) for d in done]

    @abc.abstractmethod
    async def resolve_key(self, key: str) -> tuple[str, float | None] | None:
        """(artifact id, the binding's expiry or None if permanent) of a bound key; None if unbound."""

    @abc.abstractmethod
    async def get_artifact(self, artifact_id: str) -> ArtifactRow | None: ...

    @abc.abstractmethod
    async def replicas_of(self, artifact_id: str) -> list[tuple[str, str]]:
        """(worker_id, tier) pairs."""

    @abc.abstractmethod
    async def list_artifacts(self, prefix: str, limit: int, after: str, now: float
                             ) -> tuple[list[tuple[str | None, str]], str]:
        """One page of (key, artifact id) entries, after the cursor ``after`` (``gs.refs.list_cursor``): one
        per key starting with ``prefix`` whose binding is live at ``now``, in key order; with no prefix, every
        such key and then the artifacts bound to no key at all (key None), by id. And the cursor of the next
        page ("" after the last); a page may hold fewer than ``limit`` entries before the last."""

    @abc.abstractmethod
    async def key_sizes(self, limit: int) -> tuple[list[tuple[str, int]], int]:
        """Up to ``limit`` (key, artifact bytes) pairs in key order, and how many artifacts exist (the
        dashboard's artifacts by key prefix)."""

    @abc.abstractmethod
    async def set_lease(self, artifact_id: str, key: str | None, lease_expiry: float) -> bool:
        """Give the leased reference ``key`` of the artifact (None: its anonymous one) a new expiry; False
        (nothing changes) if there is no such reference or it is permanent."""

    @abc.abstractmethod
    async def unbind(self, artifact_id: str, key: str | None, now: float, reason: str,
                     expired_only: bool = False) -> Unbound | None:
        """Atomically remove one reference: the binding of ``key`` (its key tombstone says ``reason``), or
        the anonymous reference when ``key`` is None; when no live reference remains, delete the artifact as
        ``delete_artifact`` does (with ``reason``). ``expired_only``: only a reference whose lease ended by
        ``now`` (the reaper; a renewed one is kept). None if there is no such reference (``gs.refs.
        unbind_outcome`` decides)."""

    @abc.abstractmethod
    async def delete_artifact(self, artifact_id: str, now: float, reason: str = "deleted") -> list[str]:
        """Remove the record and every reference (all its keys); its replicas become pending drops; a
        tombstone (of the id and of its keys) remembers why. Returns holder ids."""

    @abc.abstractmethod
    async def grant_read(self, artifact_id: str, worker_id: str, until: float) -> bool:
        """Record that ``worker_id`` may answer look-ups of the artifact itself until ``until`` (replacing its
        earlier lease), atomically with checking that the artifact is recorded; False (nothing recorded) if it
        is not. A grant that loses a race with a delete is refused, so every lease a delete can miss is one
        it reads afterwards (``gs.read_leases``)."""

    @abc.abstractmethod
    async def reads_of(self, artifact_id: str, now: float) -> list[tuple[str, float]]:
        """(worker, until) of the artifact's read leases that have not ended by ``now``."""

    @abc.abstractmethod
    async def end_reads(self, artifact_id: str, leases: Sequence[tuple[str, float]]) -> None:
        """Forget these (worker, until) read leases of the artifact (it is deleted and their holders were told,
        or theirs ended); one renewed since (another ``until``: the artifact was put again) is kept."""

    @abc.abstractmethod
    async def tombstone(self, key_or_id: str) -> tuple[str, str] | None:
        """(artifact id, reason) of a deleted artifact by id, or of a key by the key (unbound, or its
        artifact deleted); None if there is none."""

    @abc.abstractmethod
    async def prune_tombstones(self, before: float) -> int:
        """Forget tombstones older than ``before``; returns how many."""

    @abc.abstractmethod
    async def expired_references(self, now: float) -> list[tuple[str, str | None]]:
        """(artifact id, key) of every reference whose lease ended by ``now`` (key None: the anonymous one)."""

    @abc.abstractmethod
    async def add_replica(self, artifact_id: str, worker_id: str, tiers: tuple[str, ...],
                          restored: bool = False) -> bool:
        """Record replicas of an existing artifact; False if the artifact is unknown, or (``restored``: a
        copy announced after a restart) if this worker owes a drop of it."""

    @abc.abstractmethod
    async def remove_replica(self, artifact_id: str, worker_id: str, tier: str) -> bool:
        """Forget a replica; True when the artifact (still recorded) has no replica left."""

    @abc.abstractmethod
    async def replica_goals(self, holder: str, after: str, limit: int) -> tuple[list[GoalRow], str]:
        """One page, by id after the cursor ``after``, of the recorded artifacts whose placement wants more than
        one copy (``ArtifactInfo.replicas_wanted``, which ``commit_artifact`` records: the most any put asked
        for; ``get_artifact`` returns it): (id, wanted copies, its (worker, tier) replicas); only those with a
        replica on ``holder`` when it is given. And the cursor of the next page ("" after the last)."""
