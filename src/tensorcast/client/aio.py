"""The asyncio caller SDK: ``AsyncClient`` and ``AsyncArtifact``.

Owns: talking to a gateway (metadata) and to replica holders directly (bytes), choosing between shared
memory (same host: one copy on put, no copy on read) and payload streaming (another host), digest checks
on bytes that crossed a network, and turning records into artifacts. Does not own: the synchronous facade
(``client.sync``) or tensor conversion (``tensors``).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np

from tensorcast.client.artifact import ArtifactBase, check_target
from tensorcast.config import Config, default_host_id
from tensorcast.context import CallContext
from tensorcast.errors import InvalidArgument, NotFound, TensorCastError, Unavailable
from tensorcast.pool.segments import SegmentGone, map_private, map_shared
from tensorcast.tensors import TensorInput, digest_bytes, normalize_tensors, wrap_bytes
from tensorcast.wire.messages import (
    ArtifactInfo,
    ArtifactList,
    DeleteArtifact,
    Deleted,
    GetArtifact,
    ListArtifacts,
    ListWorkers,
    Mapped,
    MapTensors,
    PutAbort,
    PutBegin,
    PutCommit,
    PutData,
    PutDone,
    PutPlan,
    ReadTensor,
    ReleaseLease,
    RenewLease,
    ReplicaInfo,
    TensorMeta,
    WorkerInfo,
    WorkerList,
)
from tensorcast.wire.rpc import RpcChannel

__all__ = ["AsyncArtifact", "AsyncClient", "connect"]


class AsyncArtifact(ArtifactBase):
    """An immutable set of named tensors in the pool (asyncio flavour)."""

    def __init__(self, client: AsyncClient, info: ArtifactInfo) -> None:
        super().__init__(info)
        self._client = client

    async def tensor(self, name: str | None = None, like: str = "torch") -> Any:
        name = self._single_name(name)
        return (await self._client._materialize(self.info, (name,), like))[name]

    async def tensor_dict(self, like: str = "torch") -> dict[str, Any]:
        return await self._client._materialize(self.info, self.tensor_names, like)

    async def tensor_dict_into(self, targets: Mapping[str, Any]) -> None:
        """Copy each named tensor into the caller's tensor of the same name (shape and dtype must match)."""
        names = tuple(targets)
        for n in names:
            check_target(self.meta(n), targets[n])
        like = "torch" if any(type(t).__module__.startswith("torch") for t in targets.values()) else "numpy"
        sources = await self._client._materialize(self.info, names, like)
        for n in names:
            dst, src = targets[n], sources[n]
            if isinstance(dst, np.ndarray):
                np.copyto(dst, np.asarray(src))
            else:
                dst.copy_(src)

    async def renew(self, ttl: float) -> AsyncArtifact:
        self.info = await self._client._call(RenewLease(artifact_id=self.id, ttl=ttl), ArtifactInfo)
        return self

    async def release(self) -> None:
        await self._client._call(ReleaseLease(artifact_id=self.id), Deleted)

    async def refresh(self) -> AsyncArtifact:
        self.info = await self._client._call(GetArtifact(key_or_id=self.id), ArtifactInfo)
        return self


class AsyncClient:
    def __init__(self, address: str, token: str | None = None, *, config: Config | None = None) -> None:
        self.config = config or Config.load()
        self.address = address
        self.token = token if token is not None else self.config.token
        self.host_id = self.config.client.host_id or default_host_id()
        self.client_id = f"client-{uuid.uuid4().hex[:8]}"
        self._channels: dict[str, RpcChannel] = {}
        self._shm_ok = self.config.client.use_shared_memory

    # ----------------------------------------------------------------- plumbing
    def _channel(self, address: str) -> RpcChannel:
        ch = self._channels.get(address)
        if ch is None:
            ch = RpcChannel(address, self.config.wire, token=self.token, peer_id=self.client_id,
                            host_id=self.host_id)
            self._channels[address] = ch
        return ch

    def _ctx(self, timeout: float | None = None, ctx: CallContext | None = None) -> CallContext:
        base = ctx or CallContext()
        if timeout is None and base.deadline is None:
            timeout = self.config.client.timeout
        return base.with_timeout(timeout)

    async def _call(self, msg: Any, expect: type, ctx: CallContext | None = None, *, address: str | None = None,
                    **kw: Any) -> Any:
        frame = await self._channel(address or self.address).call(msg, ctx or self._ctx(), **kw)
        if not isinstance(frame.message, expect):
            raise InvalidArgument(f"unexpected reply {type(frame.message).__name__} to {type(msg).__name__}")
        return frame.message

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ----------------------------------------------------------------- artifacts
    async def put(self, tensors: Any, key: str | None = None, *, ttl: float | None = None,
                  timeout: float | None = None, ctx: CallContext | None = None) -> AsyncArtifact:
        """Store a tensor or a ``{name: tensor}`` mapping as one artifact; returns it once committed.

        ``ttl=None``: system-owned (kept until deleted). ``ttl=seconds``: caller-leased, gone when the
        lease ends unless renewed. ``key`` names the artifact; a key already in use moves to this one.
        """
        if ttl is not None and ttl <= 0:
            raise InvalidArgument(f"ttl must be > 0 seconds, got {ttl}")
        inputs = await asyncio.to_thread(normalize_tensors, tensors)
        ctx = self._ctx(timeout, ctx)
        ch = self._channel(self.address)
        welcome = await ch.connect()
        same_host = self._shm_ok and welcome.host_id == self.host_id
        metas = tuple(t.meta for t in inputs)
        plan: PutPlan = await self._call(PutBegin(tensors=metas, key=key, ttl=ttl, same_host=same_host), PutPlan,
                                         ctx)
        try:
            if not plan.exists and not plan.stream:
                try:
                    await asyncio.to_thread(_write_segments, plan, inputs)
                except SegmentGone:
                    # Same host id but /dev/shm is not shared (another container): stream instead.
                    self._shm_ok = False
                    await self._call(PutAbort(put_id=plan.put_id), object, ctx)
                    plan = await self._call(PutBegin(tensors=metas, key=key, ttl=ttl, same_host=False), PutPlan,
                                            ctx)
            if not plan.exists and plan.stream:
                for i, ref in enumerate(plan.segments):
                    if ref is not None:
                        await self._call(PutData(put_id=plan.put_id, index=i, offset=0), object, ctx,
                                         payload=memoryview(inputs[i].data))  # type: ignore[arg-type]
            done: PutDone = await self._call(PutCommit(put_id=plan.put_id), PutDone, ctx)
        except BaseException:
            await self._abort(plan.put_id)
            raise
        return AsyncArtifact(self, done.artifact)

    async def _abort(self, put_id: str) -> None:
        # Best effort: the worker reclaims abandoned puts after worker.put_timeout anyway.
        with contextlib.suppress(TensorCastError, asyncio.CancelledError):
            await self._call(PutAbort(put_id=put_id), object, CallContext().with_timeout(5.0))

    async def artifact(self, key_or_id: str, *, timeout: float | None = None) -> AsyncArtifact:
        """The artifact a key points at, or with this id; ``NotFound`` otherwise."""
        info = await self._call(GetArtifact(key_or_id=key_or_id), ArtifactInfo, self._ctx(timeout))
        return AsyncArtifact(self, info)

    async def ls(self, prefix: str = "", *, limit: int = 10_000) -> list[AsyncArtifact]:
        reply: ArtifactList = await self._call(ListArtifacts(prefix=prefix, limit=limit), ArtifactList)
        return [AsyncArtifact(self, a) for a in reply.artifacts]

    async def delete(self, key_or_id: str) -> str:
        """Delete the artifact (and every key pointing at it); returns its id."""
        reply: Deleted = await self._call(DeleteArtifact(key_or_id=key_or_id), Deleted)
        return reply.artifact_id

    async def list_workers(self) -> list[WorkerInfo]:
        reply: WorkerList = await self._call(ListWorkers(), WorkerList)
        return list(reply.workers)

    # ----------------------------------------------------------------- reading
    def _replica_order(self, info: ArtifactInfo) -> list[ReplicaInfo]:
        live = [r for r in info.replicas if r.alive and r.address]
        if not live:
            raise Unavailable(f"artifact {info.id} has no live replica")
        return sorted(live, key=lambda r: r.host_id != self.host_id)

    async def _materialize(self, info: ArtifactInfo, names: tuple[str, ...], like: str) -> dict[str, Any]:
        if like not in ("torch", "numpy"):
            raise InvalidArgument(f"like must be 'torch' or 'numpy', got {like!r}")
        metas = {t.name: t for t in info.tensors}
        for n in names:
            if n not in metas:
                raise NotFound(f"artifact {info.id} has no tensor {n!r} (has {sorted(metas)})")
        last: TensorCastError | None = None
        for replica in self._replica_order(info):
            try:
                if self._shm_ok and replica.host_id == self.host_id:
                    try:
                        return await self._map_local(info, replica, names, metas, like)
                    except SegmentGone:
                        result = await self._read_remote(info, replica, names, metas, like)
                        self._shm_ok = False  # the worker holds it, yet we cannot see its /dev/shm
                        return result
                return await self._read_remote(info, replica, names, metas, like)
            except (Unavailable, NotFound) as exc:
                last = exc
        assert last is not None
        raise last

    async def _map_local(self, info: ArtifactInfo, replica: ReplicaInfo, names: tuple[str, ...],
                         metas: dict[str, TensorMeta], like: str) -> dict[str, Any]:
        mapped: Mapped = await self._call(MapTensors(artifact_id=info.id, names=names), Mapped,
                                          address=replica.address)
        out: dict[str, Any] = {}
        for name, ref in zip(names, mapped.segments, strict=True):
            buf = None if ref is None else map_private(ref.name, ref.size)
            out[name] = wrap_bytes(buf, metas[name], like)
        return out

    async def _read_remote(self, info: ArtifactInfo, replica: ReplicaInfo, names: tuple[str, ...],
                           metas: dict[str, TensorMeta], like: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in names:
            meta = metas[name]
            buf = bytearray(meta.nbytes)
            if meta.nbytes:
                await self._call(ReadTensor(artifact_id=info.id, name=name), object, address=replica.address,
                                 sink=memoryview(buf))
                if self.config.client.verify_remote_reads:
                    got = await asyncio.to_thread(digest_bytes, memoryview(buf))
                    if got != meta.digest:
                        raise Unavailable(f"tensor {name!r} of {info.id} arrived corrupted from "
                                          f"{replica.worker_id}")
            out[name] = wrap_bytes(buf, meta, like)
        return out


def _write_segments(plan: PutPlan, inputs: list[TensorInput]) -> None:
    """Same host: copy each tensor's bytes once, straight into the segment the worker reserved."""
    for ref, item in zip(plan.segments, inputs, strict=True):
        if ref is None:
            continue
        mm = map_shared(ref.name, ref.size)
        try:
            dst = np.frombuffer(mm, dtype=np.uint8, count=ref.size)
            np.copyto(dst, item.data)
            del dst
        finally:
            mm.close()


async def connect(address: str, token: str | None = None, *, config: Config | None = None) -> AsyncClient:
    client = AsyncClient(address, token, config=config)
    await client._channel(address).connect()
    return client
