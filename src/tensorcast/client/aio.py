"""The asyncio caller SDK: ``AsyncClient``, ``AsyncArtifact`` and ``AsyncView``.

Owns: talking to a gateway (metadata, routed operations such as prefetch and unpin) and to the worker a
put lands on, the put protocol from the caller's side (same host: one copy straight into the worker's
shared memory; another host: payload frames), and turning records into artifacts and views. Does not own:
reading bytes back (``client.reads``), the synchronous facade (``client.sync``), tensor conversion
(``tensors``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from tensorcast.client.artifact import ArtifactBase, check_target
from tensorcast.client.reads import Diagnostics, Reader
from tensorcast.config import Config, default_host_id
from tensorcast.context import CallContext
from tensorcast.errors import InvalidArgument, NotFound, TensorCastError, Unavailable
from tensorcast.kv.client import AsyncKV
from tensorcast.plans.builder import Plan, PlanOutcome
from tensorcast.pool.placement import Placement, resolve_placement
from tensorcast.pool.segments import SegmentGone, map_shared
from tensorcast.tensors import ARTIFACT_ID_RE, TensorInput, normalize_tensors
from tensorcast.views import TP, TPRules, normalize_slices, sliced_shape, view_artifact_id
from tensorcast.weights.rules import rules_for
from tensorcast.wire.messages import (
    Ack,
    ArtifactInfo,
    ArtifactList,
    DeleteArtifact,
    Deleted,
    Evict,
    GetArtifact,
    InstanceCall,
    InstanceInfo,
    InstanceList,
    InstanceReply,
    ListArtifacts,
    ListInstances,
    ListShards,
    ListWorkers,
    PlanResult,
    Prefetch,
    Prefetched,
    PutAbort,
    PutBegin,
    PutCommit,
    PutData,
    PutDone,
    PutPlan,
    RegisterCheckpoint,
    ReleaseLease,
    RenewLease,
    RunPlan,
    ShardTable,
    SliceSpec,
    Unpin,
    WorkerInfo,
    WorkerList,
)
from tensorcast.wire.rpc import RpcChannel

__all__ = ["AsyncArtifact", "AsyncClient", "AsyncView", "build_view_slices", "connect"]


class AsyncView:
    """A lazy slice of an artifact's tensors; materialized (sliced by the holder) only when asked."""

    def __init__(self, artifact: AsyncArtifact, slices: dict[str, tuple[SliceSpec, ...]],
                 view_id: str | None = None) -> None:
        self.artifact = artifact
        self.slices = slices
        self.view_id = view_id or view_artifact_id(artifact.id, slices)
        self.last_diagnostics: Diagnostics | None = None

    async def _materialize(self, names: tuple[str, ...], like: str, source: str, device: str = "cpu") -> dict[str, Any]:
        """Warm: a worker already materialized this view (``prefetch(tp=...)``): map that artifact.
        Cold: slice the parent where its replica lives."""
        client = self.artifact._client
        try:
            info = await client._call(GetArtifact(key_or_id=self.view_id), ArtifactInfo)
            if any(r.alive for r in info.replicas):
                out, self.last_diagnostics = await client._reader.materialize(info, names, like, None, source,
                                                                              device)
                return out
        except (NotFound, Unavailable):
            pass
        out = await self.artifact._materialize(names, like, source, self.slices, device)
        self.last_diagnostics = self.artifact.last_diagnostics
        return out

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(self.slices)

    def shape(self, name: str) -> tuple[int, ...]:
        return sliced_shape(self.artifact.meta(name).shape, self.slices[name])

    async def tensor(self, name: str | None = None, like: str = "torch", *, source: str = "auto",
                     device: str = "cpu") -> Any:
        if name is None:
            if len(self.slices) != 1:
                raise InvalidArgument(f"view holds {len(self.slices)} tensors: name one of {list(self.slices)}")
            name = next(iter(self.slices))
        if name not in self.slices:
            raise NotFound(f"view has no tensor {name!r}")
        return (await self._materialize((name,), like, source, device))[name]

    async def tensor_dict(self, like: str = "torch", *, source: str = "auto", device: str = "cpu") -> dict[str, Any]:
        """``{name: tensor}`` of this view; ``device="cuda[:N]"``: on that GPU (see ``AsyncArtifact.tensor``)."""
        return await self._materialize(self.tensor_names, like, source, device)

    async def tensor_dict_into(self, targets: Mapping[str, Any], *, source: str = "auto") -> None:
        for n in targets:
            if n not in self.slices:
                raise NotFound(f"view has no tensor {n!r}")
            meta = self.artifact.meta(n)
            check_target(msgspec.structs.replace(meta, shape=self.shape(n)), targets[n])
        sources = await self._materialize(tuple(targets), _like(targets), source)
        _copy_into(targets, sources)


class AsyncArtifact(ArtifactBase):
    """An immutable set of named tensors in the pool (asyncio flavour)."""

    def __init__(self, client: AsyncClient, info: ArtifactInfo) -> None:
        super().__init__(info)
        self._client = client
        self.last_diagnostics: Diagnostics | None = None
        # A rank's view by its model type's rules: (slices, view id), built once (prefetch, then tensor_dict).
        self._rank_views: dict[TP, tuple[dict[str, tuple[SliceSpec, ...]], str]] = {}

    async def _materialize(self, names: tuple[str, ...], like: str, source: str,
                           slices: dict[str, tuple[SliceSpec, ...]] | None = None,
                           device: str = "cpu") -> dict[str, Any]:
        out, self.last_diagnostics = await self._client._reader.materialize(self.info, names, like, slices, source,
                                                                            device)
        return out

    async def tensor(self, name: str | None = None, like: str = "torch", *, source: str = "auto",
                     device: str = "cpu") -> Any:
        """One tensor. Same host: a copy-on-write mapping of the pool (no copy). Another host: fetched.
        ``device="cuda[:N]"`` (torch with CUDA): a same-host worker's copy on that device opened with CUDA IPC
        (no copy; see ``prefetch(device=...)``), else the host bytes copied there through pinned staging."""
        name = self._single_name(name)
        return (await self._materialize((name,), like, source, device=device))[name]

    async def tensor_dict(self, like: str = "torch", *, source: str = "auto", device: str = "cpu") -> dict[str, Any]:
        return await self._materialize(self.tensor_names, like, source, device=device)

    async def tensor_dict_into(self, targets: Mapping[str, Any], *, source: str = "auto") -> None:
        """Copy each named tensor into the caller's tensor of the same name (shape and dtype must match)."""
        for n in targets:
            check_target(self.meta(n), targets[n])
        await self._fill(targets, source, None)

    async def _fill(self, targets: Mapping[str, Any], source: str,
                    slices: dict[str, tuple[SliceSpec, ...]] | None) -> None:
        _copy_into(targets, await self._materialize(tuple(targets), _like(targets), source, slices))

    def view(self, slices: Mapping[str, Sequence[tuple[int, slice]]] | None = None, *, tp: TP | None = None,
             rules: TPRules | Mapping[str, Any] | None = None) -> AsyncView:
        """A lazy view: explicit ``slices={name: [(dim, slice), ...]}``, or one tensor-parallel rank's shard
        with ``tp=TP(rank, world_size)`` and ``rules`` (name pattern -> split dim or "replicated"; for a
        checkpoint, the rule set of its ``model_type`` by default)."""
        if tp is None or slices is not None or rules is not None:
            return AsyncView(self, build_view_slices(self.info, slices, tp, rules))
        if tp not in self._rank_views:
            view = AsyncView(self, build_view_slices(self.info, None, tp, None))
            self._rank_views[tp] = view.slices, view.view_id
        return AsyncView(self, *self._rank_views[tp])

    async def prefetch(self, to: str, *, pin: bool = False, pin_ttl: float | None = None,
                       timeout: float | None = None, streams: int = 0, tp: TP | None = None,
                       rules: TPRules | Mapping[str, Any] | None = None,
                       slices: Mapping[str, Sequence[tuple[int, slice]]] | None = None,
                       device: str = "") -> Prefetched:
        """Copy this artifact into worker ``to``'s memory (worker-to-worker; a no-op where present). With
        ``tp=TP(rank, world)`` (or ``slices``), materialize only that view there: the warm path. With
        ``device="cuda:N"`` the worker also keeps a copy on that GPU, which same-host callers then open
        with CUDA IPC (``tensor_dict(device=...)``); a worker without CUDA refuses it."""
        if tp is None and slices is None:
            done = await self._client.prefetch(self.id, to, pin=pin, pin_ttl=pin_ttl, timeout=timeout,
                                               streams=streams, device=device)
            if not done.already_present or all(r.worker_id != to or r.tier != "memory" for r in self.info.replicas):
                await self.refresh()  # reads through this handle should see the new replica
            return done
        view = self.view(slices, tp=tp, rules=rules)
        meta = {"tp": f"{tp.rank}/{tp.world_size}"} if tp is not None else {}
        msg = Prefetch(artifact_id=self.id, worker_id=to, pin=pin, pin_ttl=pin_ttl, streams=streams,
                       view=view.slices, view_id=view.view_id, view_meta=meta, device=device)
        materialized: Prefetched = await self._client._call(msg, Prefetched, self._client._ctx(timeout))
        return materialized

    async def evict(self, on: str) -> None:
        """Drop worker ``on``'s memory replica (a cache decision; its disk copy, if any, stays)."""
        await self._client._call(Evict(artifact_id=self.id, worker_id=on), Ack)

    async def pin(self, on: str, ttl: float | None = None) -> Prefetched:
        """Keep a memory replica resident on worker ``on`` (copied there first if needed) for ``ttl`` s."""
        return await self._client.prefetch(self.id, on, pin=True, pin_ttl=ttl)

    async def unpin(self, on: str) -> None:
        await self._client._call(Unpin(artifact_id=self.id, worker_id=on), Ack)

    async def renew(self, ttl: float) -> AsyncArtifact:
        self.info = await self._client._call(RenewLease(artifact_id=self.id, ttl=ttl), ArtifactInfo)
        return self

    async def release(self) -> None:
        await self._client._call(ReleaseLease(artifact_id=self.id), Deleted)

    async def refresh(self) -> AsyncArtifact:
        self.info = await self._client._call(GetArtifact(key_or_id=self.id), ArtifactInfo)
        return self


def _like(targets: Mapping[str, Any]) -> str:
    return "torch" if any(type(t).__module__.startswith("torch") for t in targets.values()) else "numpy"


def _copy_into(targets: Mapping[str, Any], sources: Mapping[str, Any]) -> None:
    for n, dst in targets.items():
        src = sources[n]
        if isinstance(dst, np.ndarray):
            np.copyto(dst, np.asarray(src))
        else:
            dst.copy_(src)


def build_view_slices(info: ArtifactInfo, slices: Mapping[str, Sequence[tuple[int, slice]]] | None,
                      tp: TP | None, rules: TPRules | Mapping[str, Any] | None) -> dict[str, tuple[SliceSpec, ...]]:
    metas = {t.name: t for t in info.tensors}
    if (slices is None) == (tp is None):
        raise InvalidArgument("a view takes either slices=... or tp=TP(rank, world_size)")
    if slices is not None:
        out = {}
        for name, spec in slices.items():
            if name not in metas:
                raise NotFound(f"artifact {info.id} has no tensor {name!r}")
            out[name] = normalize_slices(metas[name].shape, spec)
        return out
    assert tp is not None
    if rules is None:
        model_type = info.meta.get("model_type", "")
        if not model_type:
            raise InvalidArgument("a tensor-parallel view needs rules (tensor name pattern -> split dim or "
                                  "'replicated'); this artifact has no model_type to choose them by")
        config = json.loads(info.meta.get("config", "{}"))
        rule_set = rules_for(model_type, config)
    else:
        rule_set = rules if isinstance(rules, TPRules) else TPRules(rules)
    return {t.name: rule_set.slices(t.name, t.shape, tp) for t in info.tensors}


class AsyncClient:
    def __init__(self, address: str, token: str | None = None, *, config: Config | None = None) -> None:
        self.config = config or Config.load()
        self.address = address
        self.token = token if token is not None else self.config.token
        self.host_id = self.config.client.host_id or default_host_id()
        self.client_id = f"client-{uuid.uuid4().hex[:8]}"
        self._channels: dict[str, RpcChannel] = {}
        self._shm_ok = self.config.client.use_shared_memory
        self._reader = Reader(self, self.config.transport)
        self._workers: dict[str, WorkerInfo] = {}
        self.kv = AsyncKV(self)

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
        await self.kv.aclose()
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        self._reader.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ----------------------------------------------------------------- artifacts
    async def _worker_address(self, worker_id: str) -> str:
        if worker_id not in self._workers:
            self._workers = {w.worker_id: w for w in await self.list_workers()}
        try:
            return self._workers[worker_id].address
        except KeyError:
            raise NotFound(f"no worker {worker_id!r}") from None

    async def put(self, tensors: Any, key: str | None = None, *, ttl: float | None = None,
                  policy: str | Placement | None = None, on: str | None = None, timeout: float | None = None,
                  ctx: CallContext | None = None) -> AsyncArtifact:
        """Store a tensor or a ``{name: tensor}`` mapping as one artifact; returns it once committed.

        ``ttl=None``: system-owned (kept until deleted). ``ttl=seconds``: caller-leased, gone when the
        lease ends unless renewed. ``key`` names the artifact; a key already in use moves to this one.
        ``policy``: a placement preset (``cache``, ``durable``, ``ha``, ``cold``, ``warm``, ``pinned``) or a
        ``Placement``. ``on``: the worker that takes the first replica (default: the gateway).
        """
        if ttl is not None and ttl <= 0:
            raise InvalidArgument(f"ttl must be > 0 seconds, got {ttl}")
        if isinstance(policy, Placement):
            policy.validate()
        elif policy is not None:
            resolve_placement(policy)  # fail fast on an unknown preset
        inputs = await asyncio.to_thread(normalize_tensors, tensors)
        ctx = self._ctx(timeout, ctx)
        address = self.address if on is None else await self._worker_address(on)
        ch = self._channel(address)
        welcome = await ch.connect()
        same_host = self._shm_ok and welcome.host_id == self.host_id
        metas = tuple(t.meta for t in inputs)

        def begin(same: bool) -> PutBegin:
            return PutBegin(tensors=metas, key=key, ttl=ttl, same_host=same, placement=policy)

        plan: PutPlan = await self._call(begin(same_host), PutPlan, ctx, address=address)
        try:
            if not plan.exists and not plan.stream:
                try:
                    await asyncio.to_thread(_write_segments, plan, inputs)
                except SegmentGone:
                    # Same host id but /dev/shm is not shared (another container): stream instead.
                    self._shm_ok = False
                    await self._call(PutAbort(put_id=plan.put_id), object, ctx, address=address)
                    plan = await self._call(begin(False), PutPlan, ctx, address=address)
            if not plan.exists and plan.stream:
                for i, ref in enumerate(plan.segments):
                    if ref is not None:
                        await self._call(PutData(put_id=plan.put_id, index=i, offset=0), object, ctx,
                                         payload=memoryview(inputs[i].data), address=address)  # type: ignore[arg-type]
            done: PutDone = await self._call(PutCommit(put_id=plan.put_id), PutDone, ctx, address=address)
        except BaseException:
            await self._abort(plan.put_id, address)
            raise
        return AsyncArtifact(self, done.artifact)

    async def _abort(self, put_id: str, address: str) -> None:
        # Best effort: the worker reclaims abandoned puts after worker.put_timeout anyway.
        with contextlib.suppress(TensorCastError, asyncio.CancelledError):
            await self._call(PutAbort(put_id=put_id), object, CallContext().with_timeout(5.0), address=address)

    async def from_disk(self, path: str | os.PathLike[str], key: str | None = None, *, verify_checksums: bool = True,
                        on: str | None = None, timeout: float | None = None) -> AsyncArtifact:
        """Register a safetensors checkpoint (a file, or a directory, sharded or not) as an artifact without
        reading its tensor bytes; they are read on first use or on ``prefetch``. The worker (the gateway, or
        ``on``) must see ``path``. ``verify_checksums``: validate every header entry now, and refuse reads
        if a file changed since (safetensors carries no content checksums to compare against)."""
        address = self.address if on is None else await self._worker_address(on)
        msg = RegisterCheckpoint(path=str(Path(path).absolute()), key=key, verify_checksums=verify_checksums)
        info: ArtifactInfo = await self._call(msg, ArtifactInfo, self._ctx(timeout), address=address)
        return AsyncArtifact(self, info)

    async def prefetch(self, key_or_id: str, to: str, *, pin: bool = False, pin_ttl: float | None = None,
                       timeout: float | None = None, streams: int = 0, device: str = "") -> Prefetched:
        """Make worker ``to`` hold a memory replica, copied worker-to-worker (a no-op where present); with
        ``device="cuda:N"`` also a copy on that GPU of the worker, for CUDA IPC hand-offs."""
        aid = key_or_id if ARTIFACT_ID_RE.match(key_or_id) else (await self.artifact(key_or_id)).id
        msg = Prefetch(artifact_id=aid, worker_id=to, pin=pin, pin_ttl=pin_ttl, streams=streams, device=device)
        done: Prefetched = await self._call(msg, Prefetched, self._ctx(timeout))
        return done

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
        """Signal: every worker's roles, memory/disk use, network pressure and liveness (one GS read)."""
        reply: WorkerList = await self._call(ListWorkers(), WorkerList)
        return list(reply.workers)

    async def list_instances(self) -> list[InstanceInfo]:
        """Signal: every instance's home worker, load (running/waiting, KV tokens) and liveness."""
        reply: InstanceList = await self._call(ListInstances(), InstanceList)
        return list(reply.instances)

    async def call_instance(self, instance_id: str, op: str, *, request_id: str = "",
                            artifacts: Sequence[str] = (), args: Mapping[str, Any] | None = None,
                            timeout: float | None = None) -> InstanceReply:
        """Run one instance operation (publish, hydrate, transform_into, or an engine command) now."""
        msg = InstanceCall(instance_id=instance_id, op=op, request_id=request_id, artifacts=tuple(artifacts),
                           args=dict(args or {}))
        reply: InstanceReply = await self._call(msg, InstanceReply, self._ctx(timeout))
        return reply

    async def list_shards(self) -> ShardTable:
        """Signal: the KV shard leases (holder, fencing token, expiry; ``now`` is the store's clock)."""
        table: ShardTable = await self._call(ListShards(), ShardTable)
        return table

    def plan(self, ctx: CallContext | None = None) -> Plan:
        """A plan builder; ``await plan.run(concurrency=k)`` submits it to the gateway."""
        return Plan(ctx or CallContext(), self.run_plan)

    async def run_plan(self, spec: RunPlan, ctx: CallContext | None = None) -> PlanOutcome:
        result: PlanResult = await self._call(spec, PlanResult, self._ctx(None, ctx))
        return PlanOutcome(result)


def _write_segments(plan: PutPlan, inputs: list[TensorInput]) -> None:
    """Same host: copy each tensor's bytes once, straight into the segment the worker reserved."""
    for ref, item in zip(plan.segments, inputs, strict=True):
        if ref is None:
            continue
        mm = map_shared(ref.path, ref.offset + ref.size)
        try:
            dst = np.frombuffer(mm, dtype=np.uint8, count=ref.size, offset=ref.offset)
            np.copyto(dst, item.data)
            del dst
        finally:
            mm.close()


async def connect(address: str, token: str | None = None, *, config: Config | None = None) -> AsyncClient:
    client = AsyncClient(address, token, config=config)
    await client._channel(address).connect()
    return client
