"""The asyncio caller SDK: ``AsyncClient``, ``AsyncArtifact`` and ``AsyncView``.

Owns: the client's parts (one ``Caller`` for every request, the ``Locality`` switch, the data-plane
``Transport``, the ``Reader`` and the KV client) and the operations on artifacts: put, register a
checkpoint, prefetch/pin/unpin/evict, leases, listing, deleting, signals and plans. Every request goes
through ``caller.call`` with its expected reply type. Does not own: the put protocol (``client.puts``),
reading bytes back (``client.reads``), the synchronous facade (``client.sync``), tensor conversion
(``tensors``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from tensorcast.client.artifact import ArtifactBase, build_view_slices, check_target, copy_into, like_of
from tensorcast.client.binding import AsyncBinding
from tensorcast.client.group import GroupSwapResult, group_swap
from tensorcast.client.kv import AsyncKV
from tensorcast.client.locality import Locality
from tensorcast.client.publisher import AsyncWeightPublisher
from tensorcast.client.puts import put_tensors
from tensorcast.client.reads import Diagnostics, Reader
from tensorcast.client.write_maps import SegmentWriter
from tensorcast.config import Config, check_token, default_host_id
from tensorcast.context import CallContext
from tensorcast.errors import InvalidArgument, NotFound, TensorCastError, Unavailable, clip
from tensorcast.limits import check_ttl
from tensorcast.obs import tracing
from tensorcast.plans.builder import Plan, PlanOutcome
from tensorcast.pool.placement import resolve_placement
from tensorcast.records import ArtifactInfo, InstanceInfo, Placement, SliceSpec, WorkerInfo
from tensorcast.tensors import ARTIFACT_ID_RE, copy_bytes_hint, normalize_tensors
from tensorcast.transport.registry import make_transport
from tensorcast.views import TP, TPRules, sliced_shape, view_artifact_id
from tensorcast.wire.caller import Caller
from tensorcast.wire.connection import ConnectionLost, NotSent
from tensorcast.wire.kv_messages import GSStats, GSStatsReply, ListShards, ShardTable
from tensorcast.wire.messages import (
    Ack,
    ArtifactList,
    ArtifactReply,
    DeleteArtifact,
    Deleted,
    Evict,
    GetArtifact,
    InstanceCall,
    InstanceList,
    InstanceReply,
    ListArtifacts,
    ListInstances,
    ListWorkers,
    PlanResult,
    Prefetch,
    Prefetched,
    RegisterCheckpoint,
    ReleaseLease,
    RenewLease,
    RunPlan,
    Unpin,
    WorkerList,
)

__all__ = ["AsyncArtifact", "AsyncClient", "AsyncView", "connect"]

T = TypeVar("T")
# Artifacts asked for per ls request (at most the store's gs.list_page_size, 1000 by default).
_LS_PAGE = 1000
# Inputs whose normalizing copies fewer bytes than this (contiguous ones copy none) are normalized on the event
# loop (microseconds; a thread hop costs more).
_INLINE_NORMALIZE_BYTES = 1 << 20


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
        client = self.artifact.client
        try:
            info = (await client.caller.call(GetArtifact(key_or_id=self.view_id), ArtifactReply)).artifact
            if any(r.alive for r in info.replicas):
                out, self.last_diagnostics = await client.reader.materialize(info, names, like, None, source, device)
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
            raise NotFound(f"view has no tensor {clip(name)}")
        return (await self._materialize((name,), like, source, device))[name]

    async def tensor_dict(self, like: str = "torch", *, source: str = "auto", device: str = "cpu") -> dict[str, Any]:
        """``{name: tensor}`` of this view; ``device="cuda[:N]"``: on that GPU (see ``AsyncArtifact.tensor``)."""
        return await self._materialize(self.tensor_names, like, source, device)

    async def tensor_dict_into(self, targets: Mapping[str, Any], *, source: str = "auto") -> None:
        for n in targets:
            if n not in self.slices:
                raise NotFound(f"view has no tensor {clip(n)}")
            meta = self.artifact.meta(n)
            check_target(msgspec.structs.replace(meta, shape=self.shape(n)), targets[n])
        copy_into(targets, await self._materialize(tuple(targets), like_of(targets), source))


class AsyncArtifact(ArtifactBase):
    """An immutable set of named tensors in the pool (asyncio flavour)."""

    def __init__(self, client: AsyncClient, info: ArtifactInfo) -> None:
        super().__init__(info)
        self.client = client
        self.last_diagnostics: Diagnostics | None = None
        # A rank's view by its model type's rules: (slices, view id), built once (prefetch, then tensor_dict).
        self._rank_views: dict[TP, tuple[dict[str, tuple[SliceSpec, ...]], str]] = {}

    def kept_tensors(self, names: tuple[str, ...], like: str = "torch", source: str = "auto",
                     device: str = "cpu") -> dict[str, Any] | None:
        """``names`` mapped from places a same-host worker named before, with no round trip and no event loop
        (``client.read_maps``); None when they are not all kept (then ``tensor_dict`` asks). Any thread."""
        got = self.client.reader.materialize_kept(self.info, names, like, source, device)
        if got is None:
            return None
        out, self.last_diagnostics = got
        return out

    async def _materialize(self, names: tuple[str, ...], like: str, source: str,
                           slices: dict[str, tuple[SliceSpec, ...]] | None = None,
                           device: str = "cpu") -> dict[str, Any]:
        out, self.last_diagnostics = await self.client.reader.materialize(self.info, names, like, slices, source,
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
        copy_into(targets, await self._materialize(tuple(targets), like_of(targets), source))

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
        with CUDA IPC (``tensor_dict(device=...)``); a worker without CUDA refuses it. ``pin``: keep the
        copy resident (for ``pin_ttl`` seconds, or until unpinned); ``streams``: parallel TCP streams."""
        if pin_ttl is not None:
            check_ttl(pin_ttl, "pin_ttl")
        msg = Prefetch(artifact_id=self.id, worker_id=to, pin=pin, pin_ttl=pin_ttl, streams=streams, device=device)
        if tp is not None or slices is not None:
            view = self.view(slices, tp=tp, rules=rules)
            meta = {"tp": f"{tp.rank}/{tp.world_size}"} if tp is not None else {}
            msg = msgspec.structs.replace(msg, view=view.slices, view_id=view.view_id, view_meta=meta)
        elif rules is not None:
            raise InvalidArgument("rules= takes effect with tp=TP(rank, world_size)")
        done = await self.client._send_to_worker(to, msg, Prefetched, self.client.caller.context(timeout))
        if msg.view is None and done.artifact is not None:
            self.info = done.artifact  # reads through this handle see the new replica
        return done

    async def evict(self, on: str) -> None:
        """Drop worker ``on``'s memory replica (a cache decision; its disk copy, if any, stays)."""
        await self.client.caller.call(Evict(artifact_id=self.id, worker_id=on), Ack)
        self.client.reader.kept.forget(self.id, on)

    async def pin(self, on: str, ttl: float | None = None) -> Prefetched:
        """Keep a memory replica resident on worker ``on`` (copied there first if needed) for ``ttl`` s."""
        return await self.prefetch(on, pin=True, pin_ttl=ttl)

    async def unpin(self, on: str) -> None:
        await self.client.caller.call(Unpin(artifact_id=self.id, worker_id=on), Ack)

    async def renew(self, ttl: float) -> AsyncArtifact:
        """Extend a caller lease to ``ttl`` seconds from now."""
        check_ttl(ttl)
        self.info = (await self.client.caller.call(RenewLease(artifact_id=self.id, ttl=ttl), ArtifactReply)).artifact
        return self

    async def release(self) -> None:
        """End a caller lease now: the artifact is deleted."""
        await self.client.caller.call(ReleaseLease(artifact_id=self.id), Deleted)
        self.client.reader.kept.forget(self.id)

    async def refresh(self) -> AsyncArtifact:
        self.info = (await self.client.caller.call(GetArtifact(key_or_id=self.id), ArtifactReply)).artifact
        return self


class AsyncClient:
    """A caller of a cluster, through one of its gateways. ``address``: a gateway's ``HOST:PORT``, or several;
    the client also learns every live gateway when it connects, and continues through another when the one
    in use cannot be reached (calls that may be repeated are sent again, within their deadline)."""

    def __init__(self, address: str | Sequence[str], token: str | None = None, *,
                 config: Config | None = None) -> None:
        addresses = [address] if isinstance(address, str) else list(address)
        if not addresses or not all(isinstance(a, str) and a for a in addresses):
            raise InvalidArgument(f"address must be HOST:PORT or a list of them, got {clip(address)}")
        self.config = config or Config.load()
        self.address = addresses[0]
        self.token = token if token is not None else self.config.token
        check_token(self.token)
        self.host_id = self.config.client.host_id or default_host_id()
        if self.config.tracing.exporter and not tracing.active():
            tracing.configure(self.config.tracing, "tensorcast-client")  # a caller's own provider comes first
        self.client_id = f"client-{uuid.uuid4().hex[:8]}"
        self.caller = Caller(self.config.wire, token=self.token, peer_id=self.client_id, host_id=self.host_id,
                             address=addresses, timeout=self.config.client.timeout)
        self.locality = Locality(self.host_id, self.config.client.use_shared_memory)
        self.writer = SegmentWriter(idle_s=self.config.client.write_maps_idle_seconds)
        self.transport = make_transport(self.config.transport.kind, self.config.wire, token=self.token,
                                        max_streams=self.config.transport.max_streams * 2)
        self.reader = Reader(self.caller, self.transport, self.locality, self.config)
        self.kv = AsyncKV(self.caller, self.locality, self.config.kv)
        self._workers: dict[str, WorkerInfo] = {}
        self.bindings: list[AsyncBinding] = []  # closed with the client

    async def ping(self) -> None:
        """Connect to a gateway now (``Unavailable`` if none can be reached, ``Unauthenticated`` if the token
        is refused), and learn the others (to continue through one of them if this one goes away)."""
        await self.caller.connect()
        with contextlib.suppress(TensorCastError):
            workers = await self.list_workers()
            self.caller.set_defaults([w.address for w in workers if "gateway" in w.roles and w.alive])
            self._workers = {w.worker_id: w for w in workers}

    async def close(self) -> None:
        for binding in self.bindings:
            with contextlib.suppress(TensorCastError):
                await binding.close()
        await self.kv.aclose()
        await self.reader.close()
        await self.caller.close()
        self.transport.close()
        self.writer.close()

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
            raise NotFound(f"no worker {clip(worker_id)}") from None

    async def _send_to_worker(self, worker_id: str, msg: Any, expect: type[T], ctx: CallContext) -> T:
        """A request about worker ``worker_id``, sent to it directly when its address is known (one hop
        fewer than through the gateway, which routes it there too); through the gateway otherwise, or if
        that address no longer answers (the worker moved)."""
        address = self._workers[worker_id].address if worker_id in self._workers else ""
        if address and address != self.caller.address:
            try:
                return await self.caller.call(msg, expect, ctx, address=address)
            except Unavailable:
                self._workers.pop(worker_id, None)
                await self.caller.drop(address)
        return await self.caller.call(msg, expect, ctx)

    async def put(self, tensors: Any, key: str | None = None, *, ttl: float | None = None,
                  policy: str | Placement | None = None, on: str | None = None, timeout: float | None = None,
                  ctx: CallContext | None = None) -> AsyncArtifact:
        """Store a tensor or a ``{name: tensor}`` mapping as one artifact; returns it once committed.

        ``ttl=None``: system-owned (kept until deleted). ``ttl=seconds``: caller-leased, gone when the
        lease ends unless renewed. ``key`` names the artifact; a key already in use moves to this one.
        ``policy``: a placement preset (``cache``, ``durable``, ``ha``, ``cold``, ``warm``, ``pinned``) or a
        ``Placement``. ``on``: the worker that takes the first replica (default: the gateway).
        """
        if ttl is not None:
            check_ttl(ttl)
        if isinstance(policy, Placement):
            policy.validate()
        elif policy is not None:
            resolve_placement(policy)  # fail fast on an unknown preset
        copies = copy_bytes_hint(tensors)
        # Normalizing may copy (a non-contiguous tensor): on a thread, unless it copies few bytes.
        inputs = normalize_tensors(tensors) if copies is not None and copies < _INLINE_NORMALIZE_BYTES else \
            await asyncio.to_thread(normalize_tensors, tensors)
        ctx = self.caller.context(timeout, ctx)
        # One span for the whole put: its calls (begin, bytes, commit, a fail-over's second try) are children.
        attributes = {"tensors": len(inputs), **({"key": key} if key else {})} if tracing.active() else None
        with tracing.span("put", ctx.trace_id, attributes=attributes):
            return await self._put(inputs, key, ttl, policy, on, ctx)

    async def _put(self, inputs: Any, key: str | None, ttl: float | None, policy: str | Placement | None,
                   on: str | None, ctx: CallContext) -> AsyncArtifact:
        while True:
            address = self.caller.address if on is None else await self._worker_address(on)
            try:
                info = await put_tensors(self.caller, self.locality, self.writer, address, inputs, key=key,
                                         ttl=ttl, policy=policy, ctx=ctx)
                return AsyncArtifact(self, info)
            except (NotSent, ConnectionLost):
                # The gateway went away mid-put: the whole put again through another one (a put is idempotent:
                # same content, same artifact; what reached the lost worker is reclaimed or lost with it).
                if on is not None or not self.caller.fail_over(address):
                    raise

    async def from_disk(self, path: str | os.PathLike[str], key: str | None = None, *, verify_checksums: bool = True,
                        on: str | None = None, timeout: float | None = None) -> AsyncArtifact:
        """Register a safetensors checkpoint (a file, or a directory, sharded or not) as an artifact without
        reading its tensor bytes; they are read on first use or on ``prefetch``. The worker (the gateway, or
        ``on``) must see ``path``. ``verify_checksums``: validate every header entry now, and refuse reads
        if a file changed since (safetensors carries no content checksums to compare against)."""
        address = self.address if on is None else await self._worker_address(on)
        msg = RegisterCheckpoint(path=str(Path(path).absolute()), key=key, verify_checksums=verify_checksums)
        reply = await self.caller.call(msg, ArtifactReply, self.caller.context(timeout), address=address)
        return AsyncArtifact(self, reply.artifact)

    async def prefetch(self, key_or_id: str, to: str, *, pin: bool = False, pin_ttl: float | None = None,
                       timeout: float | None = None, streams: int = 0, tp: TP | None = None,
                       rules: TPRules | Mapping[str, Any] | None = None,
                       slices: Mapping[str, Sequence[tuple[int, slice]]] | None = None,
                       device: str = "") -> Prefetched:
        """Make worker ``to`` hold a memory replica of an artifact, copied worker-to-worker (a no-op where
        present); every option of ``AsyncArtifact.prefetch`` (a rank's view with ``tp``/``slices``, a GPU
        copy with ``device``, ``pin``). An artifact id needs no lookup unless a view is asked for."""
        if ARTIFACT_ID_RE.match(key_or_id) and tp is None and slices is None and rules is None:
            msg = Prefetch(artifact_id=key_or_id, worker_id=to, pin=pin, pin_ttl=pin_ttl, streams=streams,
                           device=device)
            return await self._send_to_worker(to, msg, Prefetched, self.caller.context(timeout))
        art = await self.artifact(key_or_id, timeout=timeout)
        return await art.prefetch(to, pin=pin, pin_ttl=pin_ttl, timeout=timeout, streams=streams, tp=tp, rules=rules,
                                  slices=slices, device=device)

    async def artifact(self, key_or_id: str, *, timeout: float | None = None) -> AsyncArtifact:
        """The artifact a key points at, or with this id; ``NotFound`` otherwise."""
        reply = await self.caller.call(GetArtifact(key_or_id=key_or_id), ArtifactReply, self.caller.context(timeout))
        return AsyncArtifact(self, reply.artifact)

    async def ls(self, prefix: str = "", *, limit: int | None = None) -> list[AsyncArtifact]:
        """Every artifact with a key under ``prefix`` (every artifact when empty), or the first ``limit``;
        fetched a page at a time (``gs.list_page_size`` per request), so nothing is silently cut off."""
        if limit is not None and limit < 0:
            raise InvalidArgument(f"limit must be >= 0, got {limit}")
        out: list[AsyncArtifact] = []
        seen: set[str] = set()  # an artifact with several keys under the prefix is listed once
        after = ""
        while limit is None or len(out) < limit:
            page = min(_LS_PAGE, _LS_PAGE if limit is None else limit - len(out))
            reply = await self.caller.call(ListArtifacts(prefix=prefix, limit=page, after=after), ArtifactList)
            for info in reply.artifacts:
                if info.id not in seen and (limit is None or len(out) < limit):
                    seen.add(info.id)
                    out.append(AsyncArtifact(self, info))
            if not reply.next:
                break
            after = reply.next
        return out

    async def delete(self, key_or_id: str) -> str:
        """Delete the artifact (and every key pointing at it); returns its id."""
        artifact_id = (await self.caller.call(DeleteArtifact(key_or_id=key_or_id), Deleted)).artifact_id
        self.reader.kept.forget(artifact_id)
        return artifact_id

    async def list_workers(self) -> list[WorkerInfo]:
        """Signal: every worker's roles, memory/disk use, network pressure and liveness (one GS read)."""
        return list((await self.caller.call(ListWorkers(), WorkerList)).workers)

    async def list_instances(self) -> list[InstanceInfo]:
        """Signal: every instance's home worker, load (running/waiting, KV tokens) and liveness."""
        return list((await self.caller.call(ListInstances(), InstanceList)).instances)

    async def call_instance(self, instance_id: str, op: str, *, request_id: str = "",
                            artifacts: Sequence[str] = (), args: Mapping[str, Any] | None = None,
                            timeout: float | None = None) -> InstanceReply:
        """Run one instance operation (publish, hydrate, transform_into, or an engine command) now."""
        msg = InstanceCall(instance_id=instance_id, op=op, request_id=request_id, artifacts=tuple(artifacts),
                           args=dict(args or {}))
        return await self.caller.call(msg, InstanceReply, self.caller.context(timeout))

    async def list_shards(self) -> ShardTable:
        """Signal: the KV shard leases (holder, fencing token, expiry; ``now`` is the store's clock)."""
        return await self.caller.call(ListShards(), ShardTable)

    async def metrics_urls(self) -> dict[str, str]:
        """Where every process serves Prometheus metrics: "gs" (whose root is also the dashboard), each worker
        and each instance, by id. Processes with metrics off are left out."""
        stats, workers, instances = await asyncio.gather(self.caller.call(GSStats(), GSStatsReply),
                                                         self.list_workers(), self.list_instances())
        # The answering global store is "gs"; any others (on one etcd) are "gs@ADDRESS".
        others = {f"gs@{a}": url for a, url in stats.stores.items() if url != stats.metrics_url}
        urls = {"gs": stats.metrics_url, **others, **{w.worker_id: w.metrics_url for w in workers},
                **{i.instance_id: i.metrics_url for i in instances}}
        return {name: url for name, url in urls.items() if url}

    # ----------------------------------------------------------------- weight sync (docs/weight-sync.md)
    def publisher(self, model: str, *, keep_last: int = 2, policy: str | Placement | None = None,
                  on: str | None = None) -> AsyncWeightPublisher:
        """Publishes versions of ``model`` as ``{model}@v{N}`` (unchanged tensors cost no copy) and deletes
        those beyond ``keep_last`` that no binding uses. ``policy``/``on``: as for ``put``."""
        return AsyncWeightPublisher(self, model, keep_last=keep_last, policy=policy, on=on)

    async def bind(self, model: str, *, into: Any, tp: TP | None = None,
                   rules: TPRules | Mapping[str, Any] | str | None = None,
                   sources: Mapping[str, Sequence[str]] | None = None, staging: str = "mapped",
                   holder: str | None = None, lease_ttl: float = 30.0) -> AsyncBinding:
        """Bind ``into`` (a module or ``{name: tensor}``: tensors whose addresses never change) to ``model``'s
        versions, as rank ``tp`` (its slices by ``rules``: a rule set or a model type such as "qwen2"); then
        ``swap(version)`` refills them in place. ``sources``: bound name -> version tensors concatenated along
        dim 0 (fused parameters). ``holder``: this binding's name in use records (leased for ``lease_ttl``)."""
        check_ttl(lease_ttl, "lease_ttl")
        binding = await AsyncBinding.create(self, model, into, tp=tp, rules=rules, sources=sources, staging=staging,
                                            holder=holder, lease_ttl=lease_ttl)
        self.bindings.append(binding)
        return binding

    async def group_swap(self, instances: Sequence[str], model: str, version: int | None = None, *,
                         expected: int | None = None, timeout: float | None = None,
                         fetch: str | None = None) -> GroupSwapResult:
        """Swap the binding ranks served as ``instances`` (one tensor-parallel engine) to ``version`` (default:
        the newest) together, through a gateway plan: all prepare, then all activate; ``SwapAborted`` (every
        rank kept its version) if one fails to prepare or the deadline comes first. ``fetch``: see
        ``Plan.group_swap`` (None: the whole version once per host when all ranks share a worker)."""
        return await group_swap(self, instances, model, version, expected=expected, timeout=timeout, fetch=fetch)

    def plan(self, ctx: CallContext | None = None) -> Plan:
        """A plan builder; ``await plan.run(concurrency=k)`` submits it to the gateway."""
        return Plan(ctx or CallContext(), self.run_plan)

    async def run_plan(self, spec: RunPlan, ctx: CallContext | None = None) -> PlanOutcome:
        """Run a built plan (``plan.spec()``) on the gateway and wait for its outcome."""
        return PlanOutcome(await self.caller.call(spec, PlanResult, self.caller.context(None, ctx)))


async def connect(address: str | Sequence[str], token: str | None = None, *,
                  config: Config | None = None) -> AsyncClient:
    client = AsyncClient(address, token, config=config)
    try:
        await client.ping()
    except BaseException:
        await client.close()
        raise
    return client
