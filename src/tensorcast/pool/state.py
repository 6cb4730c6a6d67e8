"""Pure accounting of a worker's memory tier: capacity, reservations, content-addressed blobs, artifacts.

Owns: the decisions (does a put fit, which blobs must be uploaded, which blobs become free when an
artifact goes) as a state machine fed events and returning what to do; no files, sockets or clocks.
Blobs are keyed by content digest and reference-counted by the artifacts that use them, so two artifacts
sharing a tensor store its bytes once. Does not own: the segments themselves (``pool.memory``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorcast.errors import ResourceExhausted

__all__ = ["PoolState"]


@dataclass
class PoolState:
    capacity: int
    used: int = 0  # bytes of committed blobs
    reserved: int = 0  # bytes of blobs being uploaded
    blob_refs: dict[str, int] = field(default_factory=dict)
    blob_size: dict[str, int] = field(default_factory=dict)
    artifacts: dict[str, tuple[str, ...]] = field(default_factory=dict)  # id -> distinct digests

    def has_blob(self, digest: str) -> bool:
        return digest in self.blob_refs

    def reserve(self, nbytes: int) -> None:
        """Reserve room for an upload or raise ``ResourceExhausted``; nothing changes on refusal."""
        if self.used + self.reserved + nbytes > self.capacity:
            raise ResourceExhausted(
                f"memory tier full: {nbytes} bytes requested, {self.capacity - self.used - self.reserved} of "
                f"{self.capacity} free"
            )
        self.reserved += nbytes

    def unreserve(self, nbytes: int) -> None:
        self.reserved -= nbytes
        assert self.reserved >= 0

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

    def add_artifact(self, artifact_id: str, digests: tuple[str, ...]) -> bool:
        """Reference the artifact's blobs (all must be stored). False if it was already held."""
        if artifact_id in self.artifacts:
            return False
        distinct = tuple(dict.fromkeys(digests))
        for d in distinct:
            self.blob_refs[d] += 1
        self.artifacts[artifact_id] = distinct
        return True

    def remove_artifact(self, artifact_id: str) -> list[str]:
        """Drop the artifact; return the digests no artifact references any more (to free)."""
        freed: list[str] = []
        for d in self.artifacts.pop(artifact_id, ()):
            self.blob_refs[d] -= 1
            if self.blob_refs[d] == 0:
                freed.append(d)
        return freed

    def free_blob(self, digest: str) -> None:
        if self.blob_refs.get(digest) == 0:
            del self.blob_refs[digest]
            self.used -= self.blob_size.pop(digest)

    def release_unreferenced(self) -> list[str]:
        """Blobs stored but referenced by no artifact (e.g. a put committed its blobs then failed)."""
        return [d for d, n in self.blob_refs.items() if n == 0]
