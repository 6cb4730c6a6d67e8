"""Pure accounting and eviction decisions for a worker's memory tier.

Owns: capacity and reservations, content-addressed blobs reference-counted by the memory replicas that
use them (two artifacts sharing a tensor store its bytes once), per-replica state (LRU clock, pin, memory
TTL, evictable) and the eviction choice: least-recently-used evictable, unpinned replicas, counting only
bytes that really become free (a blob shared with a survivor frees nothing). A state machine fed events
(reserve, commit, add, touch, pin, remove) that returns decisions (victims, blobs to free); no files,
sockets or clocks. Does not own: segments (``pool.memory``), the disk tier (``pool.disk``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tensorcast.errors import ResourceExhausted

__all__ = ["MemoryReplica", "PoolState"]


@dataclass
class MemoryReplica:
    artifact_id: str
    digests: tuple[str, ...]  # distinct digests of its non-empty tensors
    evictable: bool = True
    pinned_until: float | None = None  # math.inf: until unpinned
    last_access: float = 0.0
    memory_expires: float | None = None  # cold placement: drop the memory copy then

    def is_pinned(self, now: float) -> bool:
        return self.pinned_until is not None and self.pinned_until > now

    def can_evict(self, now: float) -> bool:
        return self.evictable and not self.is_pinned(now)


@dataclass
class PoolState:
    capacity: int
    used: int = 0  # bytes of committed blobs
    reserved: int = 0  # bytes of blobs being written
    blob_refs: dict[str, int] = field(default_factory=dict)
    blob_size: dict[str, int] = field(default_factory=dict)
    replicas: dict[str, MemoryReplica] = field(default_factory=dict)

    @property
    def free(self) -> int:
        return self.capacity - self.used - self.reserved

    def has_blob(self, digest: str) -> bool:
        return digest in self.blob_refs

    # ----------------------------------------------------------------- room
    def reserve(self, nbytes: int) -> None:
        """Reserve room or raise ``ResourceExhausted``; nothing changes on refusal."""
        if nbytes > self.free:
            raise ResourceExhausted(
                f"memory tier full: {nbytes} bytes requested, {max(self.free, 0)} of {self.capacity} free"
            )
        self.reserved += nbytes

    def unreserve(self, nbytes: int) -> None:
        self.reserved -= nbytes
        assert self.reserved >= 0

    def victims(self, need: int, now: float, exclude: frozenset[str] = frozenset()) -> list[str]:
        """The least-recently-used evictable replicas whose removal frees ``need`` bytes beyond what is free
        now; ``[]`` if it already fits. Raises ``ResourceExhausted`` if even evicting all candidates would
        not make room (and then nothing is chosen)."""
        short = need - self.free
        if short <= 0:
            return []
        refs = dict(self.blob_refs)
        freed = 0
        chosen: list[str] = []
        candidates = sorted((r for r in self.replicas.values()
                             if r.can_evict(now) and r.artifact_id not in exclude), key=lambda r: r.last_access)
        for rep in candidates:
            chosen.append(rep.artifact_id)
            for d in rep.digests:
                refs[d] -= 1
                if refs[d] == 0:
                    freed += self.blob_size[d]
            if freed >= short:
                return chosen
        raise ResourceExhausted(
            f"memory tier full: {need} bytes requested, {max(self.free, 0)} free and only {freed} more could be "
            f"freed by evicting unpinned replicas (capacity {self.capacity})"
        )

    def watermark_victims(self, high: float, low: float, now: float) -> list[str]:
        """Above ``high`` (fraction of capacity), the replicas to evict to get back under ``low``."""
        if self.used + self.reserved <= high * self.capacity:
            return []
        target = self.used + self.reserved - int(low * self.capacity)
        try:
            return self.victims(target + self.free, now)
        except ResourceExhausted:
            return [r.artifact_id for r in sorted(self.replicas.values(), key=lambda r: r.last_access)
                    if r.can_evict(now)]

    # ----------------------------------------------------------------- blobs and replicas
    def commit_blob(self, digest: str, nbytes: int) -> bool:
        """Turn a reservation into a stored blob. False if the digest was stored meanwhile (the new copy
        is a duplicate the caller must free)."""
        self.unreserve(nbytes)
        if digest in self.blob_refs:
            return False
        self.blob_refs[digest] = 0
        self.blob_size[digest] = nbytes
        self.used += nbytes
        return True

    def add_replica(self, rep: MemoryReplica) -> bool:
        """Reference the replica's blobs (all must be stored). False if it was already held (then only its
        pin/expiry/evictability are merged: the stronger promise wins)."""
        cur = self.replicas.get(rep.artifact_id)
        if cur is not None:
            cur.evictable = cur.evictable and rep.evictable
            if rep.pinned_until is not None:
                cur.pinned_until = max(cur.pinned_until or 0.0, rep.pinned_until)
            if cur.memory_expires is not None:
                cur.memory_expires = None if rep.memory_expires is None else max(cur.memory_expires,
                                                                                 rep.memory_expires)
            cur.last_access = max(cur.last_access, rep.last_access)
            return False
        rep.digests = tuple(dict.fromkeys(rep.digests))
        for d in rep.digests:
            self.blob_refs[d] += 1
        self.replicas[rep.artifact_id] = rep
        return True

    def remove_replica(self, artifact_id: str) -> list[str]:
        """Drop the replica; return the digests no replica references any more (to free)."""
        rep = self.replicas.pop(artifact_id, None)
        freed: list[str] = []
        for d in rep.digests if rep else ():
            self.blob_refs[d] -= 1
            if self.blob_refs[d] == 0:
                freed.append(d)
        return freed

    def free_blob(self, digest: str) -> int:
        if self.blob_refs.get(digest) == 0:
            del self.blob_refs[digest]
            size = self.blob_size.pop(digest)
            self.used -= size
            return size
        return 0

    def replicas_using(self, digest: str) -> list[str]:
        """The replicas that reference blob ``digest``."""
        return [r.artifact_id for r in self.replicas.values() if digest in r.digests]

    def unreferenced(self) -> list[str]:
        return [d for d, n in self.blob_refs.items() if n == 0]

    def touch(self, artifact_id: str, now: float) -> None:
        rep = self.replicas.get(artifact_id)
        if rep is not None:
            rep.last_access = now

    def pin(self, artifact_id: str, until: float | None) -> None:
        rep = self.replicas[artifact_id]
        rep.pinned_until = math.inf if until is None else until
        rep.memory_expires = None  # a pinned copy stays resident

    def unpin(self, artifact_id: str) -> None:
        rep = self.replicas.get(artifact_id)
        if rep is not None:
            rep.pinned_until = None

    def pinned_bytes(self, now: float) -> int:
        """Bytes of the blobs that pinned replicas hold (a blob shared by two pinned replicas counts once)."""
        digests = {d for r in self.replicas.values() if r.is_pinned(now) for d in r.digests}
        return sum(self.blob_size[d] for d in digests)

    def expired(self, now: float) -> list[str]:
        """Memory copies whose placement TTL (cold) has passed and that are not pinned."""
        return [r.artifact_id for r in self.replicas.values()
                if r.memory_expires is not None and r.memory_expires <= now and not r.is_pinned(now)]
