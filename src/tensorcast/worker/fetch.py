"""Pulling an artifact into this worker's memory tier: from its own disk tier or from a peer.

Owns: the prefetch/pin path of a destination worker — make room, pick sources (this worker's disk copy
first, then peers' memory replicas, then peers' disk replicas), move each missing tensor over the data
plane straight into a freshly allocated (pre-faulted) segment with several streams, retry a range whose
chunk failed its checksum, fall back to the next replica when a source dies, and record the new replica.
Nothing partial is ever kept: a failed fetch frees what it allocated. Blobs held here that a same-host caller
wrote are checked before a fetch counts on them (``worker.trust``); a peer checks what it sends, so fetched
bytes are checked ones. Does not own: the transport itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import blake3
import msgspec
import numpy as np

from tensorcast.checksums import ChunkCorrupted
from tensorcast.config import TransportConfig
from tensorcast.errors import NotFound, TensorCastError, Unavailable, clip
from tensorcast.pool.memory import BlobLoc
from tensorcast.pool.placement import PRESETS
from tensorcast.pool.sources import rank_sources
from tensorcast.records import ArtifactInfo, ReplicaInfo, SliceSpec, TensorMeta
from tensorcast.tensors import numpy_dtype, raw_dtype
from tensorcast.transport.base import Transport, stream_count
from tensorcast.views import apply_slices, byte_range, sliced_shape
from tensorcast.weights.reader import ReadJob, SliceJob, read_ranges
from tensorcast.wire.messages import DataRequest, Prefetched
from tensorcast.worker.store import LocalStore
from tensorcast.worker.trust import BlobTrust

__all__ = ["Fetcher", "view_digest"]


def view_digest(digest: str, specs: tuple[SliceSpec, ...]) -> str:
    """Identity of a slice of a tensor: derived from the source's digest and the slices, not re-hashed."""
    if not specs:
        return digest
    return str(blake3.blake3(_ENC.encode([digest, list(specs)])).hexdigest())


def _copy_slices(src: memoryview, meta: TensorMeta, specs: tuple[SliceSpec, ...], dest: memoryview) -> None:
    dtype = raw_dtype(meta.dtype)  # bytes are bytes: copy through a plain integer dtype
    arr = np.frombuffer(src, dtype=np.uint8).view(dtype).reshape(meta.shape) if meta.nbytes else \
        np.empty(meta.shape, dtype)
    part = apply_slices(arr, specs) if specs else arr
    out = np.frombuffer(dest, dtype=np.uint8).view(dtype).reshape(part.shape)
    np.copyto(out, part)

log = logging.getLogger("tensorcast.worker")
_ENC = msgspec.msgpack.Encoder()


class Fetcher:
    def __init__(self, worker_id: str, store: LocalStore, trust: BlobTrust, transport: Transport,
                 config: TransportConfig, host_id: str = "") -> None:
        self.worker_id = worker_id
        self.host_id = host_id
        self.store = store
        self.trust = trust
        self.transport = transport
        self.config = config
        self.in_flight = 0
        self._running: dict[str, asyncio.Future[Prefetched]] = {}  # artifact id -> fetch in progress

    async def fetch(self, info: ArtifactInfo, deadline: float | None, trace_id: str, streams: int = 0) -> Prefetched:
        """Make this worker hold a memory replica of ``info``. Concurrent fetches of one artifact (e.g. every
        rank of an engine asking at once) share one transfer; the others report it as already present."""
        running = self._running.get(info.id)
        if running is not None:
            await asyncio.shield(running)
            return Prefetched(worker_id=self.worker_id, already_present=True)
        task = asyncio.ensure_future(self._fetch(info, deadline, trace_id, streams))
        self._running[info.id] = task
        def finished(t: asyncio.Future[Prefetched]) -> None:
            self._running.pop(info.id, None)
            if not t.cancelled():
                t.exception()  # retrieved: its callers (if any are left) got it

        task.add_done_callback(finished)
        return await asyncio.shield(task)  # a caller that gives up leaves the transfer to the others

    async def _fetch(self, info: ArtifactInfo, deadline: float | None, trace_id: str, streams: int) -> Prefetched:
        store = self.store
        if store.memory.has_replica(info.id):
            store.touch(info.id)
            return Prefetched(worker_id=self.worker_id, already_present=True)
        placement = PRESETS.get(info.policy, PRESETS["cache"])
        if not placement.wants_memory:
            placement = PRESETS["cache"]
        digests = [t.digest for t in info.tensors if t.nbytes]
        await self.trust.ensure(digests)  # count only on checked bytes held here
        missing = {t.digest: t for t in info.tensors if t.nbytes and not store.memory.has_blob(t.digest)}
        await store.make_room(sum(t.nbytes for t in missing.values()), exclude=frozenset({info.id}))
        t0 = time.perf_counter()
        result = Prefetched(worker_id=self.worker_id, already_present=False)
        with self._staging() as allocated:
            await self._allocate(allocated, list(missing.values()))
            # A checkpoint registered in place here: one batch of parallel preads for all its tensors.
            where = store.external_locations(info.id, (m.name for m in missing.values()))
            reads = {d: ReadJob(ext.file, ext.offset, allocated[d].view(), m.name, ext.etag)
                     for d, m in missing.items() if (ext := where.get(m.name)) is not None}
            await self._read_in_place(list(reads.values()))
            in_place = {d: m for d, m in missing.items() if d in reads}
            rest = {d: m for d, m in missing.items() if d not in reads}
            # Several tensors at once (each may itself use several streams): small tensors would otherwise
            # move one at a time.
            fills = await self._bounded([self._fill(info, meta, allocated[d], deadline, trace_id, streams)
                                         for d, meta in rest.items()])
            fills += [("", "disk", 0)] * len(in_place)
            for (source, tier, retries), meta in zip(fills, [*rest.values(), *in_place.values()], strict=True):
                result = Prefetched(worker_id=self.worker_id, already_present=False, source=source,
                                    source_tier=tier, bytes_moved=result.bytes_moved + meta.nbytes,
                                    retries=result.retries + retries)
            await self.trust.settle(digests)  # blobs stored meanwhile are checked before ours defer to them
            self._commit(allocated)
            if any(t.nbytes and not store.memory.has_blob(t.digest) for t in info.tensors):
                raise Unavailable(f"a tensor of {info.id} was evicted during the fetch; retry")
            store.add_memory_replica(info.id, info.tensors, placement)
        return Prefetched(worker_id=self.worker_id, already_present=False, source=result.source,
                          source_tier=result.source_tier, bytes_moved=result.bytes_moved,
                          seconds=time.perf_counter() - t0, retries=result.retries)

    async def materialize_view(self, info: ArtifactInfo, view: dict[str, tuple[SliceSpec, ...]], view_id: str,
                               deadline: float | None, trace_id: str) -> tuple[Prefetched, tuple[TensorMeta, ...]]:
        """Build artifact ``view_id`` in memory from slices of ``info``'s tensors: read here (a checkpoint in
        place with parallel preads, or a local replica) or fetched sliced from a peer. Returns its tensors."""
        store = self.store
        if store.memory.has_replica(view_id):
            store.touch(view_id)
            return Prefetched(worker_id=self.worker_id, already_present=True), store.memory.tensors(view_id)
        metas = {t.name: t for t in info.tensors}
        unknown = sorted(set(view) - set(metas))
        if unknown:
            raise NotFound(f"artifact {info.id} has no tensors {unknown[:5]}")
        out: list[TensorMeta] = []
        for name in sorted(view):
            meta, specs = metas[name], view[name]
            shape = sliced_shape(meta.shape, specs) if specs else meta.shape
            nbytes = int(np.prod(shape, dtype=np.int64)) * numpy_dtype(meta.dtype).itemsize
            out.append(TensorMeta(name=name, dtype=meta.dtype, shape=shape, nbytes=nbytes,
                                  digest=view_digest(meta.digest, specs)))
        await self.trust.ensure(metas[n].digest for n in view)  # sliced from checked bytes only
        await store.make_room(sum(t.nbytes for t in out), exclude=frozenset({view_id}))
        t0 = time.perf_counter()
        with self._staging() as allocated:
            todo = list({t.digest: t for t in out if t.nbytes and not store.memory.has_blob(t.digest)}.values())
            await self._allocate(allocated, todo)
            # Slices of a checkpoint in place here: one batch of parallel preads of just their bytes (a
            # contiguous slice), and copies out of the mapped file (the others) sharing the same threads.
            direct: dict[str, ReadJob | SliceJob] = {}
            where = store.external_locations(info.id, (t.name for t in todo))
            for t in todo:
                if (ext := where.get(t.name)) is None:
                    continue
                meta, specs, dest = metas[t.name], view[t.name], allocated[t.digest].view()
                rng = byte_range(meta.shape, numpy_dtype(meta.dtype).itemsize, specs) if specs else (0, meta.nbytes)
                direct[t.digest] = ReadJob(ext.file, ext.offset + rng[0], dest, t.name, ext.etag) \
                    if rng is not None else SliceJob(ext.file, ext.offset, meta.dtype, meta.shape, specs, dest,
                                                     t.name, ext.etag)
            await self._read_in_place(list(direct.values()))
            sources = [self.worker_id] * bool(direct) + await self._bounded([
                self._fill_view(info, metas[t.name], view[t.name], allocated[t.digest], deadline, trace_id)
                for t in todo if t.digest not in direct])
            source = next((s for s in sources if s), "")
            moved = sum(t.nbytes for t in todo)
            self._commit(allocated)
            store.add_memory_replica(view_id, tuple(out), PRESETS["cache"])
        return Prefetched(worker_id=self.worker_id, already_present=False, source=source, source_tier="disk",
                          bytes_moved=moved, seconds=time.perf_counter() - t0), tuple(out)

    async def _fill_view(self, info: ArtifactInfo, meta: TensorMeta, specs: tuple[SliceSpec, ...], loc: BlobLoc,
                         deadline: float | None, trace_id: str) -> str:
        itemsize = numpy_dtype(meta.dtype).itemsize
        rng = byte_range(meta.shape, itemsize, specs) if specs else (0, meta.nbytes)
        # (A checkpoint in place here never comes this way: ``materialize_view`` reads it in one batch.)
        if self.store.memory.is_verified(meta.digest) or (
                self.store.disk is not None and self.store.disk.is_verified(meta.digest)):
            src, _tier, release = self.store.lease_tensor(info.id, meta, "")
            try:
                await asyncio.to_thread(_copy_slices, src, meta, specs, loc.view())
            finally:
                release()
            return self.worker_id
        last: TensorCastError = NotFound(f"artifact {info.id} has no live replica to slice {clip(meta.name)} from")
        for replica in self._sources(info):
            req = DataRequest(artifact_id=info.id, name=meta.name, tier=replica.tier)
            req = msgspec.structs.replace(req, offset=rng[0], length=rng[1] - rng[0]) if rng is not None else \
                msgspec.structs.replace(req, slices=specs)
            try:
                await asyncio.to_thread(self.transport.fetch, replica.data_address, req, loc.view(),
                                        streams=stream_count(self.config, loc.size), deadline=deadline,
                                        trace_id=trace_id)
                return replica.worker_id
            except (Unavailable, NotFound) as exc:
                last = exc
        raise last

    @contextlib.contextmanager
    def _staging(self) -> Iterator[dict[str, BlobLoc]]:
        """Blobs being filled (digest -> allocation). If anything fails they are all discarded, so nothing
        partial is ever kept; ``_commit`` stores them."""
        allocated: dict[str, BlobLoc] = {}
        self.in_flight += 1
        try:
            yield allocated
        except BaseException:
            for loc in allocated.values():
                self.store.memory.discard(loc)
            self.store.memory.release_unreferenced()
            raise
        finally:
            self.in_flight -= 1

    async def _read_in_place(self, reads: list[ReadJob | SliceJob]) -> None:
        """One batch of parallel reads from checkpoint files registered in place on this worker."""
        if reads:
            await asyncio.to_thread(read_ranges, reads, streams=self.config.max_streams)

    async def _allocate(self, allocated: dict[str, BlobLoc], metas: list[TensorMeta]) -> None:
        """One pack for the batch, carved out of pre-faulted chunks (off the loop: it may create segments)."""
        locs = await asyncio.to_thread(self.store.memory.allocate_pack, [t.nbytes for t in metas])
        allocated.update(zip((t.digest for t in metas), locs, strict=True))

    def _commit(self, allocated: dict[str, BlobLoc]) -> None:
        for digest, loc in allocated.items():
            self.store.memory.commit_blob(digest, loc)
        allocated.clear()

    async def _bounded(self, coros: list[Any]) -> list[Any]:
        """Run fills concurrently, at most ``transport.max_streams`` at a time; the first error wins."""
        sem = asyncio.Semaphore(self.config.max_streams)

        async def one(coro: Any) -> Any:
            async with sem:
                return await coro

        return list(await asyncio.gather(*(one(c) for c in coros)))

    def _sources(self, info: ArtifactInfo) -> list[ReplicaInfo]:
        """Peers' memory before any disk (a peer's memory beats a disk read), this host's first."""
        peers = (r for r in info.replicas if r.worker_id != self.worker_id and r.alive and r.data_address)
        return rank_sources(peers, self.host_id, "prefer_p2p")

    async def _fill(self, info: ArtifactInfo, meta: TensorMeta, loc: BlobLoc, deadline: float | None,
                    trace_id: str, streams: int) -> tuple[str, str, int]:
        """Fill ``loc`` with ``meta``'s bytes; returns (source worker, tier, retries)."""
        disk = self.store.disk
        if disk is not None and disk.is_verified(meta.digest):  # (unchecked: ``trust.ensure`` came first)
            src, tier, release = self.store.lease_blob(meta, "disk")
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

