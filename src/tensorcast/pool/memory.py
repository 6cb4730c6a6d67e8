"""A worker's memory tier: ``PoolState`` decisions applied to real shared-memory segments.

Owns: allocating segments under the capacity, committing uploaded blobs (deduplicated by digest),
holding artifacts as sets of blobs, and freeing segments whose last artifact went. Segments that are
still being read (a payload being sent) are closed later. Does not own: the put protocol (``worker``).
"""

from __future__ import annotations

from tensorcast.errors import NotFound
from tensorcast.pool.segments import Segment, remove_stale_segments
from tensorcast.pool.state import PoolState
from tensorcast.wire.messages import TensorMeta

__all__ = ["MemoryPool"]


class MemoryPool:
    def __init__(self, capacity: int, prefix: str) -> None:
        self.state = PoolState(capacity)
        self.prefix = prefix
        self._blobs: dict[str, Segment] = {}
        self._artifacts: dict[str, tuple[TensorMeta, ...]] = {}
        self._closing: list[Segment] = []
        remove_stale_segments(prefix)

    # ----------------------------------------------------------------- uploads
    def allocate(self, nbytes: int) -> Segment:
        self.state.reserve(nbytes)
        try:
            return Segment.create(self.prefix, nbytes)
        except BaseException:
            self.state.unreserve(nbytes)
            raise

    def discard(self, segment: Segment) -> None:
        """Give back an allocation that was never committed."""
        self.state.unreserve(segment.size)
        self._retire(segment)

    def commit_blob(self, digest: str, segment: Segment) -> None:
        if not self.state.commit_blob(digest, segment.size):
            self._retire(segment)  # someone stored the same bytes first
        else:
            self._blobs[digest] = segment

    def has_blob(self, digest: str) -> bool:
        return self.state.has_blob(digest)

    # ----------------------------------------------------------------- artifacts
    def add_artifact(self, artifact_id: str, tensors: tuple[TensorMeta, ...]) -> None:
        if self.state.add_artifact(artifact_id, tuple(t.digest for t in tensors if t.nbytes)):
            self._artifacts[artifact_id] = tensors

    def has_artifact(self, artifact_id: str) -> bool:
        return artifact_id in self._artifacts

    def tensors(self, artifact_id: str) -> tuple[TensorMeta, ...]:
        try:
            return self._artifacts[artifact_id]
        except KeyError:
            raise NotFound(f"artifact {artifact_id} has no replica on this worker") from None

    def segment(self, digest: str) -> Segment:
        return self._blobs[digest]

    def remove_artifact(self, artifact_id: str) -> bool:
        if self._artifacts.pop(artifact_id, None) is None:
            return False
        for digest in self.state.remove_artifact(artifact_id):
            self.state.free_blob(digest)
            self._retire(self._blobs.pop(digest))
        return True

    def release_unreferenced(self) -> None:
        for digest in self.state.release_unreferenced():
            self.state.free_blob(digest)
            self._retire(self._blobs.pop(digest))

    def artifact_ids(self) -> list[str]:
        return list(self._artifacts)

    # ----------------------------------------------------------------- segments
    def _retire(self, segment: Segment) -> None:
        segment.unlink()
        if not segment.try_close():
            self._closing.append(segment)

    def collect(self) -> None:
        """Unmap retired segments whose readers have finished."""
        self._closing = [s for s in self._closing if not s.try_close()]

    def close(self) -> None:
        for seg in list(self._blobs.values()) + self._closing:
            seg.unlink()
            seg.try_close()
        self._blobs.clear()
        self._closing.clear()
        remove_stale_segments(self.prefix)
