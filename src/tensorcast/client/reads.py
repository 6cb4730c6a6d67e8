"""Materializing artifacts and views on the caller's side: pick a replica, map or fetch, report.

Owns: the source order (``auto``: this host's memory, this host's disk, other workers' memory, other
workers' disk; ``local_only``; ``prefer_p2p``: any memory replica before any disk one; ``prefer_disk``),
same-host zero-copy mapping (copy-on-write), fetching over the data plane for other hosts (several
streams for large ranges; slices cut by the holder, so only their bytes travel), retries (a corrupted
chunk is fetched again; a failed holder makes way for the next replica), and ``Diagnostics``. With
``device="cuda[:N]"``: a same-host worker's copy on that device is opened with CUDA IPC (no copy);
otherwise the host tensors above are copied to the device through pinned staging buffers, pipelined
(``transport.h2d``). Holds the caller, the transport and the locality it is given; does not own the
client (``client.aio``) or any connection.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from tensorcast.checksums import ChunkCorrupted
from tensorcast.client.locality import Locality
from tensorcast.config import Config
from tensorcast.context import CallContext
from tensorcast.cuda import cuda_available
from tensorcast.errors import InvalidArgument, NotFound, TensorCastError, Unavailable, clip
from tensorcast.pool.segments import SegmentGone, map_private
from tensorcast.records import ArtifactInfo, ReplicaInfo, SliceSpec, TensorMeta
from tensorcast.tensors import digest_bytes, import_torch, numpy_dtype, raw_dtype, wrap_bytes
from tensorcast.transport.base import Transport, stream_count
from tensorcast.transport.cuda_ipc import import_handle
from tensorcast.transport.h2d import to_device
from tensorcast.views import apply_slices, byte_range, sliced_shape
from tensorcast.wire.caller import Caller
from tensorcast.wire.messages import DataRequest, Mapped, MapTensors

__all__ = ["SOURCES", "Diagnostics", "Reader"]

SOURCES = ("auto", "local_only", "prefer_p2p", "prefer_disk")


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

    def order(self, info: ArtifactInfo, source: str) -> list[ReplicaInfo]:
        if source not in SOURCES:
            raise InvalidArgument(f"source must be one of {SOURCES}, got {clip(source)}")
        local_host = self.locality.host_id
        live = [r for r in info.replicas if r.alive and r.address]
        if source == "local_only":
            live = [r for r in live if r.host_id == local_host]

        def rank(r: ReplicaInfo) -> tuple[int, ...]:
            remote = r.host_id != local_host
            disk = r.tier == "disk"
            if source == "prefer_p2p":
                return (disk, remote)
            if source == "prefer_disk":
                return (not disk, remote)
            return (remote, disk)

        ordered = sorted(live, key=rank)
        if not ordered:
            where = "on this host" if source == "local_only" else "that is alive"
            raise Unavailable(f"artifact {info.id} has no replica {where}")
        return ordered

    async def materialize(self, info: ArtifactInfo, names: tuple[str, ...], like: str,
                          slices: Mapping[str, tuple[SliceSpec, ...]] | None = None,
                          source: str = "auto", device: str = "cpu",
                          ctx: CallContext | None = None) -> tuple[dict[str, Any], Diagnostics]:
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

    async def _map_local(self, info: ArtifactInfo, replica: ReplicaInfo, names: tuple[str, ...],
                         metas: dict[str, TensorMeta], like: str, slices: Mapping[str, tuple[SliceSpec, ...]],
                         diag: Diagnostics, device: str, ctx: CallContext) -> dict[str, Any]:
        want_ipc = device != "cpu" and not any(slices.get(n) for n in names)
        msg = MapTensors(artifact_id=info.id, names=names, tier=replica.tier, device=device if want_ipc else "")
        mapped = await self.caller.call(msg, Mapped, ctx, address=replica.address)
        if want_ipc and len(mapped.cuda_ipc) == len(names):
            diag.transport = "cuda-ipc"
            return {n: import_handle(h) for n, h in zip(names, mapped.cuda_ipc, strict=True)}
        diag.transport = "shared-memory"
        out: dict[str, Any] = {}
        unmapped: list[str] = []
        by_file: dict[str, list[tuple[str, tuple[int, int]]]] = {}
        for name, ref in zip(names, mapped.segments, strict=True):
            if ref is None and metas[name].nbytes:
                unmapped.append(name)  # a slab-arena object: copied out over the data plane
            elif ref is not None:
                by_file.setdefault(ref.path, []).append((name, (ref.offset, ref.size)))
        bufs: dict[str, memoryview] = {}
        for path, refs in by_file.items():  # one mapping per file (a pack chunk, a checkpoint file)
            bufs.update(zip((n for n, _ in refs), map_private(path, [span for _, span in refs]), strict=True))
        for name in names:
            meta, buf = metas[name], bufs.get(name)
            if buf is None and meta.nbytes:
                continue  # unmapped: fetched below
            spec = slices.get(name, ())
            out[name] = wrap_bytes(buf, meta, like) if not spec else _slice_local(buf, meta, spec, like)
        if unmapped:
            out.update(await self._fetch(info, replica, tuple(unmapped), metas, like, slices, diag, ctx))
            diag.transport = "shared-memory"
        return out

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
