"""The asyncio caller SDK: ``AsyncClient`` (and its handles, ``AsyncArtifact`` and ``AsyncView``, re-exported).

Owns: the client's parts (one ``Caller`` for every request, the ``Locality`` switch, the data-plane
``Transport``, the ``Reader``, the worker directory and the KV client) and the cluster-wide operations: put,
register a checkpoint, prefetch by key, look up, list and delete artifacts, signals, weight sync and plans.
Every request goes through ``caller.call`` with its expected reply type. Does not own: what a handle does with
one artifact (``client.handles``), the put protocol (``client.puts``), reading bytes back (``client.reads``),
the synchronous facade (``client.sync``), tensor conversion (``tensors``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Unpack

from tensorcast.client.artifact import Deletion, PrefetchOptions, prefetch_request, wants_view
from tensorcast.client.binding import AsyncBinding
from tensorcast.client.group import GroupSwapResult, group_swap
from tensorcast.client.handles import AsyncArtifact, AsyncView, deleted
from tensorcast.client.kv import AsyncKV
from tensorcast.client.locality import Locality
from tensorcast.client.publisher import AsyncWeightPublisher
from tensorcast.client.puts import put_tensors
from tensorcast.client.reads import Reader
from tensorcast.client.workers import WorkerDirectory
from tensorcast.client.write_maps import SegmentWriter
from tensorcast.config import Config, default_host_id
from tensorcast.config_loading import check_token
from tensorcast.context import CallContext
from tensorcast.errors import InvalidArgument, TensorCastError, clip
from tensorcast.limits import check_ttl
from tensorcast.obs import tracing
from tensorcast.plans.builder import Plan, PlanOutcome
from tensorcast.pool.placement import resolve_placement
from tensorcast.records import InstanceInfo, Placement, WorkerInfo
from tensorcast.tensors import ARTIFACT_ID_RE, copy_bytes_hint, normalize_tensors
from tensorcast.transport.registry import make_transport
from tensorcast.views import TP, TPRules
from tensorcast.weights.object_store import is_object_url
from tensorcast.wire.caller import Caller
from tensorcast.wire.connection import ConnectionLost, NotSent
from tensorcast.wire.kv_messages import GSStats, ListShards, ShardTable
from tensorcast.wire.messages import (
    ArtifactReply,
    DeleteArtifact,
    GetArtifact,
    InstanceCall,
    InstanceReply,
    ListArtifacts,
    ListInstances,
    ListWorkers,
    Prefetched,
    RegisterCheckpoint,
    RunPlan,
)

__all__ = ["AsyncArtifact", "AsyncClient", "AsyncView", "connect"]

# Artifacts asked for per ls request (at most the store's gs.list_page_size, 1000 by default).
_LS_PAGE = 1000
# Inputs whose normalizing copies fewer bytes than this (contiguous ones copy none) are normalized on the event
# loop (microseconds; a thread hop costs more).
_INLINE_NORMALIZE_BYTES = 1 << 20


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
                             address=addresses, timeout=self.config.client.timeout, tls=self.config.tls)
        self.locality = Locality(self.host_id, self.config.client.use_shared_memory)
        self.writer = SegmentWriter(idle_s=self.config.client.write_maps_idle_seconds)
        self.transport = make_transport(self.config.transport.kind, self.config.wire, token=self.token,
                                        max_streams=self.config.transport.max_streams * 2, tls=self.config.tls)
        self.reader = Reader(self.caller, self.transport, self.locality, self.config)
        self.kv = AsyncKV(self.caller, self.locality, self.config.kv)
        self.workers = WorkerDirectory(self.caller)
        self.bindings: list[AsyncBinding] = []  # closed with the client

    async def ping(self) -> None:
        """Connect to a gateway now (``Unavailable`` if none can be reached, ``Unauthenticated`` if the token
        is refused), and learn the others (to continue through one of them if this one goes away)."""
        await self.caller.connect()
        with contextlib.suppress(TensorCastError):
            workers = await self.list_workers()
            self.caller.set_defaults([w.address for w in workers if "gateway" in w.roles and w.alive])
            self.workers.learn(workers)

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
    async def put(self, tensors: Any, key: str | None = None, *, ttl: float | None = None,
                  policy: str | Placement | None = None, on: str | None = None, timeout: float | None = None,
                  ctx: CallContext | None = None) -> AsyncArtifact:
        """Store a tensor or a ``{name: tensor}`` mapping as one artifact; returns it once committed.

        ``key`` names it (a key in use moves here; keys are independent names). This put's reference (``key``,
        or an anonymous one) is kept until deleted with ``ttl=None``, else leased (``renew``/``release``).
        ``policy``: a preset (``cache``, ``durable``, ``ha``, ``cold``, ``warm``, ``pinned``) or a ``Placement``
        (result ``copies`` < ``replicas_wanted``: fewer live workers took one). ``on``: the first replica's worker.
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
            address = self.caller.address if on is None else await self.workers.address(on)
            try:
                info = await put_tensors(self.caller, self.locality, self.writer, address, inputs, key=key,
                                         ttl=ttl, policy=policy, ctx=ctx)
                return AsyncArtifact(self, info, key)
            except (NotSent, ConnectionLost):
                # The gateway went away mid-put: the whole put again through another one (a put is idempotent:
                # same content, same artifact; what reached the lost worker is reclaimed or lost with it).
                if on is not None or not self.caller.fail_over(address):
                    raise

    async def from_disk(self, path: str | os.PathLike[str], key: str | None = None, *, verify_checksums: bool = True,
                        on: str | None = None, timeout: float | None = None) -> AsyncArtifact:
        """Register a safetensors checkpoint (a file, or a directory, sharded or not) as an artifact without
        reading its tensor bytes; they are read on first use or on ``prefetch``. The worker (the gateway, or
        ``on``) must see ``path``: a local path, or ``s3://bucket/prefix`` in an S3-compatible store the
        worker may read (``weights.object_prefixes``; headers read with ranged GETs, ``docs/weights.md``).
        ``verify_checksums``: validate every header entry now, and refuse reads if a file changed since
        (safetensors carries no content checksums to compare against; an object is pinned to its ETag). Without ``on``
        it goes to the gateway in use and, like every call that may be repeated, on to another one if that
        gateway cannot be reached."""
        address = None if on is None else await self.workers.address(on)
        where = path if is_object_url(path) else str(Path(path).absolute())
        msg = RegisterCheckpoint(path=str(where), key=key, verify_checksums=verify_checksums)
        reply = await self.caller.call(msg, self.caller.context(timeout), address=address)
        return AsyncArtifact(self, reply.artifact, key)

    async def prefetch(self, key_or_id: str, to: str, **options: Unpack[PrefetchOptions]) -> Prefetched:
        """Make worker ``to`` hold a memory replica of an artifact, copied worker-to-worker (a no-op where
        present); every option of ``AsyncArtifact.prefetch`` (``PrefetchOptions``: a rank's view with
        ``tp``/``slices``, a GPU copy with ``device``, ``pin``). An artifact id needs no lookup unless a view is
        asked for."""
        if ARTIFACT_ID_RE.match(key_or_id) and not wants_view(options):
            msg = prefetch_request(key_or_id, to, options)
            return await self.workers.send(to, msg, self.caller.context(options.get("timeout")))
        art = await self.lookup(key_or_id, timeout=options.get("timeout"), to_read=False)
        return await art.prefetch(to, **options)

    async def artifact(self, key_or_id: str, *, timeout: float | None = None) -> AsyncArtifact:
        """The artifact a key points at (a handle of that key), or with this id; ``NotFound`` otherwise."""
        return await self.lookup(key_or_id, timeout=timeout)

    async def lookup(self, key_or_id: str, *, timeout: float | None = None, to_read: bool = True) -> AsyncArtifact:
        """``artifact``; ``to_read=False`` for a handle that will not be read (to unpin, release or prefetch
        it): the gateway is then not asked for its places (naming them makes a segment unfit for recycling)."""
        msg, ctx = self.lookup_request(key_or_id, timeout=timeout, to_read=to_read)
        return self.looked_up(key_or_id, await self.caller.call(msg, ctx))

    def lookup_request(self, key_or_id: str, *, timeout: float | None = None, ctx: CallContext | None = None,
                       to_read: bool = True) -> tuple[GetArtifact, CallContext]:
        """``lookup``'s request and its context, without sending it (a synchronous client sends it on the
        caller's thread: ``client.thread_calls``). Any thread."""
        # Places asked for even when kept already: a gateway answering an id under a read lease (``gs.
        # read_leases``) does so only to a caller asking for them, without asking the store.
        want = to_read and self.locality.shared_memory and self.reader.kept.max_entries > 0
        return GetArtifact(key_or_id=key_or_id, map=want), self.caller.context(timeout, ctx)

    def looked_up(self, key_or_id: str, reply: ArtifactReply) -> AsyncArtifact:
        """The handle ``lookup`` returns for ``reply`` (the places it names kept for the first read). Any
        thread."""
        if reply.segments and len(reply.segments) == len(reply.artifact.tensors):  # its first read: no call
            self.reader.kept.remember(reply.artifact.id, reply.mapped_by, [t.name for t in reply.artifact.tensors],
                                      reply.segments)
        by_id = ARTIFACT_ID_RE.match(key_or_id) is not None
        return AsyncArtifact(self, reply.artifact, None if by_id else key_or_id)

    async def ls(self, prefix: str = "", *, limit: int | None = None) -> list[AsyncArtifact]:
        """One handle per key under ``prefix`` in key order (two keys of one artifact: two handles); with no
        prefix, then every artifact no key names (``key`` None). Or the first ``limit``; fetched a page at a
        time (``gs.list_page_size`` per request), so nothing is silently cut off."""
        if limit is not None and limit < 0:
            raise InvalidArgument(f"limit must be >= 0, got {limit}")
        out: list[AsyncArtifact] = []
        after = ""
        while limit is None or len(out) < limit:
            page = min(_LS_PAGE, _LS_PAGE if limit is None else limit - len(out))
            reply = await self.caller.call(ListArtifacts(prefix=prefix, limit=page, after=after))
            entries = zip(reply.artifacts, reply.entry_keys, strict=True)
            out += [AsyncArtifact(self, info, key or None) for info, key in entries][:page]
            if not reply.next:
                break
            after = reply.next
        return out

    async def delete(self, key_or_id: str) -> Deletion:
        """By key: unbind that key; the bytes go when no other key or lease refers to them. By id: delete the
        content with every key. Returns the id as a ``Deletion`` (``removed``: the content went; ``keys``)."""
        return await deleted(self, DeleteArtifact(key_or_id=key_or_id))

    async def list_workers(self) -> list[WorkerInfo]:
        """Signal: every worker's roles, memory/disk use, network pressure and liveness (one GS read)."""
        return list((await self.caller.call(ListWorkers())).workers)

    async def list_instances(self) -> list[InstanceInfo]:
        """Signal: every instance's home worker, load (running/waiting, KV tokens) and liveness."""
        return list((await self.caller.call(ListInstances())).instances)

    async def call_instance(self, instance_id: str, op: str, *, request_id: str = "",
                            artifacts: Sequence[str] = (), args: Mapping[str, Any] | None = None,
                            timeout: float | None = None) -> InstanceReply:
        """Run one instance operation (publish, hydrate, transform_into, or an engine command) now."""
        msg = InstanceCall(instance_id=instance_id, op=op, request_id=request_id, artifacts=tuple(artifacts),
                           args=dict(args or {}))
        return await self.caller.call(msg, self.caller.context(timeout))

    async def list_shards(self) -> ShardTable:
        """Signal: the KV shard leases (holder, fencing token, expiry; ``now`` is the store's clock)."""
        return await self.caller.call(ListShards())

    async def metrics_urls(self) -> dict[str, str]:
        """Where every process serves Prometheus metrics: "gs" (whose root is also the dashboard), each worker
        and each instance, by id. Processes with metrics off are left out."""
        stats, workers, instances = await asyncio.gather(self.caller.call(GSStats()),
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
        return PlanOutcome(await self.caller.call(spec, self.caller.context(None, ctx)))


async def connect(address: str | Sequence[str], token: str | None = None, *,
                  config: Config | None = None) -> AsyncClient:
    client = AsyncClient(address, token, config=config)
    try:
        await client.ping()
    except BaseException:
        await client.close()
        raise
    return client
