"""Pulling an artifact into this worker's memory tier: from its own disk tier or from a peer.

Owns: the prefetch/pin path of a destination worker — make room, pick sources (this worker's disk copy
first, then peers' memory replicas, then peers' disk replicas), move each missing tensor over the data
plane straight into a freshly allocated (pre-faulted) segment with several streams, retry a range whose
chunk failed its checksum, fall back to the next replica when a source dies, and record the new replica.
Nothing partial is ever kept: a failed fetch frees what it allocated. Does not own: the transport itself.
"""

from __future__ import annotations

import asyncio
import logging
import time

from tensorcast.config import TransportConfig
from tensorcast.errors import NotFound, TensorCastError, Unavailable
from tensorcast.pool.memory import BlobLoc
from tensorcast.pool.placement import PRESETS
from tensorcast.transport.base import ChunkCorrupted, stream_count
from tensorcast.transport.tcp import TcpTransport
from tensorcast.wire.messages import ArtifactInfo, DataRequest, Prefetched, ReplicaInfo, TensorMeta
from tensorcast.worker.store import LocalStore

__all__ = ["Fetcher"]

log = logging.getLogger("tensorcast.worker")


class Fetcher:
    def __init__(self, worker_id: str, store: LocalStore, transport: TcpTransport, config: TransportConfig) -> None:
        self.worker_id = worker_id
        self.store = store
        self.transport = transport
        self.config = config
        self.in_flight = 0

    async def fetch(self, info: ArtifactInfo, deadline: float | None, trace_id: str, streams: int = 0) -> Prefetched:
        store = self.store
        if store.memory.has_replica(info.id):
            store.touch(info.id)
            return Prefetched(worker_id=self.worker_id, already_present=True)
        placement = PRESETS.get(info.policy, PRESETS["cache"])
        if not placement.wants_memory:
            placement = PRESETS["cache"]
        missing = {t.digest: t for t in info.tensors if t.nbytes and not store.memory.has_blob(t.digest)}
        await store.make_room(sum(t.nbytes for t in missing.values()), "evict", exclude=frozenset({info.id}))
        t0 = time.perf_counter()
        allocated: dict[str, BlobLoc] = {}
        result = Prefetched(worker_id=self.worker_id, already_present=False)
        self.in_flight += 1
        try:
            for digest, meta in missing.items():
                loc = store.memory.allocate(meta.nbytes)
                allocated[digest] = loc
                source, tier, retries = await self._fill(info, meta, loc, deadline, trace_id, streams)
                result = Prefetched(worker_id=self.worker_id, already_present=False, source=source,
                                    source_tier=tier, bytes_moved=result.bytes_moved + meta.nbytes,
                                    retries=result.retries + retries)
            for digest, loc in allocated.items():
                store.memory.commit_blob(digest, loc)
            allocated.clear()
            if any(t.nbytes and not store.memory.has_blob(t.digest) for t in info.tensors):
                raise Unavailable(f"a tensor of {info.id} was evicted during the fetch; retry")
            store.add_memory_replica(info.id, info.tensors, placement)
        except BaseException:
            for loc in allocated.values():
                store.memory.discard(loc)
            store.memory.release_unreferenced()
            raise
        finally:
            self.in_flight -= 1
        return Prefetched(worker_id=self.worker_id, already_present=False, source=result.source,
                          source_tier=result.source_tier, bytes_moved=result.bytes_moved,
                          seconds=time.perf_counter() - t0, retries=result.retries)

    def _sources(self, info: ArtifactInfo) -> list[ReplicaInfo]:
        peers = [r for r in info.replicas if r.worker_id != self.worker_id and r.alive and r.data_address]
        return sorted(peers, key=lambda r: r.tier != "memory")

    async def _fill(self, info: ArtifactInfo, meta: TensorMeta, loc: BlobLoc, deadline: float | None,
                    trace_id: str, streams: int) -> tuple[str, str, int]:
        """Fill ``loc`` with ``meta``'s bytes; returns (source worker, tier, retries)."""
        disk = self.store.disk
        if disk is not None and disk.has_blob(meta.digest):
            src, tier, release = self.store._lease_bytes(meta, "disk")
            try:
                await asyncio.to_thread(loc.view().__setitem__, slice(None), src)
            finally:
                release()
            return "", tier, 0
        retries = 0
        last: TensorCastError = NotFound(f"artifact {info.id} has no live replica on another worker")
        for replica in self._sources(info):
            for _attempt in range(self.config.retries + 1):
                checksums: list[int] = []
                try:
                    stats = await asyncio.to_thread(
                        self.transport.fetch, replica.data_address,
                        DataRequest(artifact_id=info.id, name=meta.name, tier=replica.tier), loc.view(),
                        streams=streams or stream_count(self.config, meta.nbytes), deadline=deadline,
                        trace_id=trace_id,
                        checksums=checksums)
                    self.store.remember_checksums(meta.digest, checksums)
                    return replica.worker_id, stats.tier, retries
                except ChunkCorrupted as exc:
                    log.warning("corrupted chunk from %s, retrying: %s", replica.worker_id, exc)
                    retries += 1
                    last = exc
                except (Unavailable, NotFound) as exc:
                    log.warning("source %s failed for %s: %s", replica.worker_id, meta.name, exc)
                    retries += 1
                    last = exc
                    break  # try the next replica
        raise last

