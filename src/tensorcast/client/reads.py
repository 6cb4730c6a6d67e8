"""Materializing artifacts and views on the caller's side: pick a replica, map or fetch, report.

Owns: the source order (``auto``: this host's memory, this host's disk, other workers' memory, other workers'
disk; ``local_only``; ``prefer_p2p``: any memory replica before any disk one; ``prefer_disk``), same-host zero-
copy mapping (copy-on-write; after the first, from places kept in ``client.read_maps``, with the reads reported to
the worker in the background at most every ``client.read_report_seconds``), fetching over the data plane for other
hosts (several streams for large ranges; slices cut by the holder, so only their bytes travel), retries (a
corrupted chunk is fetched again; a failed holder makes way for the next replica), and ``Diagnostics``. With
``device="cuda[:N]"``: a same-host worker's copy on that device is opened with CUDA IPC (no copy); otherwise the
host tensors above are copied to the device through pinned staging buffers, pipelined (``transport.h2d``). Holds
the caller, the transport and the locality it is given; does not own the client (``client.aio``) or any
connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from tensorcast.checksums import ChunkCorrupted
from tensorcast.client.locality import Locality
from tensorcast.client.read_maps import ReadMaps
from tensorcast.config import Config
from tensorcast.context import CallContext
from tensorcast.cuda import cuda_available
from tensorcast.errors import InvalidArgument, NotFound, TensorCastError, Unavailable, clip
from tensorcast.pool.segments import SegmentGone, map_private
from tensorcast.pool.sources import SOURCES, rank_sources
from tensorcast.records import ArtifactInfo, ReplicaInfo, SegmentRef, SliceSpec, TensorMeta
from tensorcast.tensors import digest_bytes, import_torch, numpy_dtype, raw_dtype, wrap_bytes
from tensorcast.transport.base import Transport, stream_count
from tensorcast.transport.cuda_ipc import import_handle
from tensorcast.transport.h2d import to_device
from tensorcast.views import apply_slices, byte_range, sliced_shape
from tensorcast.wire.caller import Caller
from tensorcast.wire.messages import (
    MAX_REPORTED_READS,
    DataRequest,
    MapTensors,
    ReadCount,
    ReportReads,
)

__all__ = ["SOURCES", "Diagnostics", "Reader"]

log = logging.getLogger("tensorcast.client")



@dataclass
class Diagnostics:
    """How a materialization was served."""

    replica: str = ""  # worker id
    tier: str = ""  # memory | disk
    transport: str = ""  # shared-memory | tcp
    bytes_moved: int = 0  # bytes that crossed a socket (0 for a same-host mapping)
    seconds: float = 0.0
    retries: int = 0
    streams: int = 0
    failed_replicas: list[str] = field(default_factory=list)


class Reader:
    def __init__(self, caller: Caller, transport: Transport, locality: Locality, config: Config) -> None:
        self.caller = caller
        self.transport = transport
        self.locality = locality
        self.config = config.transport
        self.verify_remote_reads = config.client.verify_remote_reads
        self.kept = ReadMaps(config.client.read_map_entries)
        self.report_s = config.client.read_report_seconds
        self._report_timers: dict[str, asyncio.TimerHandle] = {}
        self._reported_at: dict[str, float] = {}
        self._report_tasks: set[asyncio.Future[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None  # the client's loop, where reports are sent from
        self._closed = False

    def order(self, info: ArtifactInfo, source: str) -> list[ReplicaInfo]:
        ordered = rank_sources((r for r in info.replicas if r.alive and r.address), self.locality.host_id, source)
        if not ordered:
            where = "on this host" if source == "local_only" else "that is alive"
            raise Unavailable(f"artifact {info.id} has no replica {where}")
        return ordered

    async def materialize(self, info: ArtifactInfo, names: tuple[str, ...], like: str,
                          slices: Mapping[str, tuple[SliceSpec, ...]] | None = None,
                          source: str = "auto", device: str = "cpu",
                          ctx: CallContext | None = None) -> tuple[dict[str, Any], Diagnostics]:
        self._loop = asyncio.get_running_loop()
        ctx = self.caller.context(ctx=ctx)
        if like not in ("torch", "numpy"):
            raise InvalidArgument(f"like must be 'torch' or 'numpy', got {clip(like)}")
        if like == "torch":
            import_torch()  # refused before anything is read when torch is missing
        if device != "cpu":
            if like != "torch":
                raise InvalidArgument(f"device {clip(device)} needs like='torch'")
            if not device.startswith("cuda") or not cuda_available():
                raise InvalidArgument(f"device {clip(device)}: this process has no such device (CUDA devices need "
                                      "torch with CUDA and a GPU); use device='cpu'")
        metas = {t.name: t for t in info.tensors}
        for n in names:
            if n not in metas:
                raise NotFound(f"artifact {info.id} has no tensor {clip(n)} (has {sorted(metas)})")
        slices = slices or {}
        diag = Diagnostics()
        t0 = time.perf_counter()
        last: TensorCastError | None = None
        for replica in self.order(info, source):
            diag.replica, diag.tier = replica.worker_id, replica.tier
            try:
                if self.locality.same_host(replica.host_id):
                    try:
                        out = await self._map_local(info, replica, names, metas, like, slices, diag, device, ctx)
                    except SegmentGone:
                        out = await self._fetch(info, replica, names, metas, like, slices, diag, ctx)
                        self.locality.shared_memory_unreachable()  # the worker holds it; its files are not here
                else:
                    out = await self._fetch(info, replica, names, metas, like, slices, diag, ctx)
                if device != "cpu" and diag.transport != "cuda-ipc":
                    out = await asyncio.to_thread(to_device, out, device)
                    diag.transport += "+h2d"
                diag.seconds = time.perf_counter() - t0
                return out, diag
            except (Unavailable, NotFound) as exc:
                diag.failed_replicas.append(replica.worker_id)
                diag.retries += 1
                last = exc
        assert last is not None
        raise last

    def materialize_kept(self, info: ArtifactInfo, names: tuple[str, ...], like: str, source: str = "auto",
                         device: str = "cpu", slices: Mapping[str, tuple[SliceSpec, ...]] | None = None,
                         ) -> tuple[dict[str, Any], Diagnostics] | None:
        """The tensors (cut by ``slices``, a view's) mapped from places kept for the replica ``materialize``
        would read first, if it is a same-host memory replica whose places are kept; else None (then
        ``materialize``). No round trip and no event loop: safe to call from any thread (a synchronous client
        calls it on the caller's thread)."""
        if device != "cpu" or like not in ("torch", "numpy") or source not in SOURCES or self._loop is None \
                or self._closed:
            return None  # (a closed client: the usual path says so)
        try:
            replica = self.order(info, source)[0]
        except Unavailable:
            return None
        if not self.locality.same_host(replica.host_id):
            return None
        t0 = time.perf_counter()
        out = self._read_kept(info, replica, names, {t.name: t for t in info.tensors}, like, slices or {})
        if out is None:
            return None
        return out, Diagnostics(replica=replica.worker_id, tier="memory", transport="shared-memory",
                                seconds=time.perf_counter() - t0)

    def _read_kept(self, info: ArtifactInfo, replica: ReplicaInfo, names: tuple[str, ...],
                   metas: dict[str, TensorMeta], like: str,
                   slices: Mapping[str, tuple[SliceSpec, ...]]) -> dict[str, Any] | None:
        """``names`` mapped from the places kept for a same-host memory ``replica``, the read counted for the
        next report; None when they are not all kept, or their segment went (then the worker is asked)."""
        if replica.tier != "memory" or self._closed:
            return None
        kept = self.kept.places(info.id, replica.worker_id, names)
        if kept is None:
            return None
        try:
            out = self._map_refs(names, metas, kept, like, slices)
        except SegmentGone:  # the segment went (its artifact was deleted or evicted)
            self.kept.forget(info.id, replica.worker_id)
            return None
        self._count_kept_read(replica.address, info.id, kept)
        return out

    def _count_kept_read(self, address: str, artifact_id: str, refs: Sequence[SegmentRef]) -> None:
        self.kept.count_read(address, artifact_id, sum(r.size for r in refs))
        if address in self._report_timers:
            return  # the pending report takes this read too (it takes the counts after its timer fired)
        loop = self._loop
        assert loop is not None
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._report_soon(address)
        else:
            with contextlib.suppress(RuntimeError):  # the client closed meanwhile: the report is advisory
                loop.call_soon_threadsafe(self._report_soon, address)

    async def _map_local(self, info: ArtifactInfo, replica: ReplicaInfo, names: tuple[str, ...],
                         metas: dict[str, TensorMeta], like: str, slices: Mapping[str, tuple[SliceSpec, ...]],
                         diag: Diagnostics, device: str, ctx: CallContext) -> dict[str, Any]:
        want_ipc = device != "cpu" and not any(slices.get(n) for n in names)
        if not want_ipc and (out := self._read_kept(info, replica, names, metas, like, slices)) is not None:
            diag.transport = "shared-memory"
            return out
        msg = MapTensors(artifact_id=info.id, names=names, tier=replica.tier, device=device if want_ipc else "")
        mapped = await self.caller.call(msg, ctx, address=replica.address)
        if want_ipc and len(mapped.cuda_ipc) == len(names):
            diag.transport = "cuda-ipc"
            return {n: import_handle(h) for n, h in zip(names, mapped.cuda_ipc, strict=True)}
        diag.transport = "shared-memory"
        out = self._map_refs(names, metas, mapped.segments, like, slices)
        self.kept.remember(info.id, replica.worker_id, names, mapped.segments)
        unmapped = tuple(n for n in names if n not in out)
        if unmapped:  # slab-arena objects: copied out over the data plane
            out.update(await self._fetch(info, replica, unmapped, metas, like, slices, diag, ctx))
            diag.transport = "shared-memory"
        return out

    @staticmethod
    def _map_refs(names: tuple[str, ...], metas: dict[str, TensorMeta], refs: Sequence[SegmentRef | None],
                  like: str, slices: Mapping[str, tuple[SliceSpec, ...]]) -> dict[str, Any]:
        """Map the named places, one mapping per file (a pack chunk, a checkpoint file); a tensor without a
        place (and with bytes) is left out, for the caller to read."""
        by_file: dict[str, list[tuple[str, tuple[int, int]]]] = {}
        for name, ref in zip(names, refs, strict=True):
            if ref is not None:
                by_file.setdefault(ref.path, []).append((name, (ref.offset, ref.size)))
        bufs: dict[str, memoryview] = {}
        for path, spans in by_file.items():
            bufs.update(zip((n for n, _ in spans), map_private(path, [span for _, span in spans]), strict=True))
        out: dict[str, Any] = {}
        for name in names:
            meta, buf = metas[name], bufs.get(name)
            if buf is None and meta.nbytes:
                continue
            spec = slices.get(name, ())
            out[name] = wrap_bytes(buf, meta, like) if not spec else _slice_local(buf, meta, spec, like)
        return out

    # ----------------------------------------------------------------- read reports
    def _report_soon(self, address: str) -> None:
        """Report the reads served from kept places of one worker: now if none was started in the last
        ``report_s``, else when that interval ends. Off the caller's path. Reports are advisory: one that fails,
        or that a closing client cancels, is not sent again (the worker misses some uses and gets)."""
        if address in self._report_timers or self._closed:
            return
        loop = asyncio.get_running_loop()
        delay = max(0.0, self._reported_at.get(address, -math.inf) + self.report_s - loop.time())
        self._report_timers[address] = loop.call_later(delay, self._start_report, address)

    def _start_report(self, address: str) -> None:
        self._report_timers.pop(address, None)
        if self._closed:
            return
        task = asyncio.ensure_future(self._report(address))
        self._report_tasks.add(task)
        task.add_done_callback(self._report_tasks.discard)

    async def _report(self, address: str, timeout: float | None = None) -> None:
        reads = self.kept.take_reports(address)
        if not reads:
            return
        self._reported_at[address] = asyncio.get_running_loop().time()
        ctx = self.caller.context(timeout=timeout or max(self.report_s, 1.0) * 5)
        for at in range(0, len(reads), MAX_REPORTED_READS):  # a worker takes this many artifacts per report
            msg = ReportReads(reads=tuple(ReadCount(artifact_id=a, reads=n, nbytes=b)
                                          for a, n, b in reads[at : at + MAX_REPORTED_READS]))
            try:
                await self.caller.call(msg, ctx, address=address)
            except TensorCastError as exc:  # advisory: a lost report costs the worker uses and metrics, no bytes
                log.debug("read report to %s failed: %s", address, exc)
                return

    async def close(self) -> None:
        """Stop reporting; send the reads not reported yet, waiting at most half a second (a report is advisory:
        a worker that does not answer does not hold up the close)."""
        self._closed = True
        for timer in self._report_timers.values():
            timer.cancel()
        self._report_timers.clear()
        for task in self._report_tasks:
            task.cancel()
        await asyncio.gather(*[self._report(a, timeout=0.5) for a in self.kept.pending()], *self._report_tasks,
                             return_exceptions=True)

    async def _fetch(self, info: ArtifactInfo, replica: ReplicaInfo, names: tuple[str, ...],
                     metas: dict[str, TensorMeta], like: str, slices: Mapping[str, tuple[SliceSpec, ...]],
                     diag: Diagnostics, ctx: CallContext) -> dict[str, Any]:
        diag.transport = self.transport.kind
        if not replica.data_address:
            raise Unavailable(f"worker {replica.worker_id} has no data-plane address")
        out: dict[str, Any] = {}
        for name in names:
            meta = metas[name]
            spec = slices.get(name, ())
            itemsize = numpy_dtype(meta.dtype).itemsize
            shape = sliced_shape(meta.shape, spec) if spec else meta.shape
            nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
            req = DataRequest(artifact_id=info.id, name=name, tier=replica.tier)
            rng = byte_range(meta.shape, itemsize, spec) if spec else (0, meta.nbytes)
            if rng is not None:
                req = msgspec.structs.replace(req, offset=rng[0], length=rng[1] - rng[0])
            else:
                req = msgspec.structs.replace(req, slices=spec)
            buf = np.empty(nbytes, dtype=np.uint8)
            if nbytes:
                await self._fetch_into(replica, req, buf.data, diag, ctx)
                if not spec and self.verify_remote_reads and \
                        await asyncio.to_thread(digest_bytes, buf.data) != meta.digest:
                    raise Unavailable(f"tensor {clip(name)} of {info.id} from {replica.worker_id} failed its digest")
            out[name] = wrap_bytes(buf, msgspec.structs.replace(meta, shape=shape, nbytes=nbytes), like)
        return out

    async def _fetch_into(self, replica: ReplicaInfo, req: DataRequest, dest: memoryview, diag: Diagnostics,
                          ctx: CallContext) -> None:
        streams = stream_count(self.config, len(dest))
        for attempt in range(self.config.retries + 1):
            try:
                stats = await asyncio.to_thread(self.transport.fetch, replica.data_address, req, dest,
                                                streams=streams, deadline=ctx.deadline, trace_id=ctx.trace_id)
                diag.bytes_moved += stats.bytes
                diag.streams = max(diag.streams, stats.streams)
                diag.tier = stats.tier or diag.tier
                return
            except ChunkCorrupted:
                diag.retries += 1
                if attempt == self.config.retries:
                    raise


def _slice_local(buf: Any, meta: TensorMeta, spec: tuple[SliceSpec, ...], like: str) -> Any:
    """Slice a mapped tensor here (no bytes move): zero-copy if the slice is contiguous, else one copy."""
    dtype = raw_dtype(meta.dtype)  # copied as plain integers: numpy's fast paths
    full = np.frombuffer(buf, dtype=dtype, count=meta.nbytes // dtype.itemsize).reshape(meta.shape) \
        if meta.nbytes else np.empty(meta.shape, dtype)
    part = np.ascontiguousarray(apply_slices(full, spec))
    raw = part.reshape(-1).view(np.uint8)
    return wrap_bytes(raw if part.nbytes else None,
                      msgspec.structs.replace(meta, shape=part.shape, nbytes=part.nbytes), like)
