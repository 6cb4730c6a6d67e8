"""The synchronous caller SDK: ``Client`` and ``Artifact``, plus the process-default client.

Owns: running the asyncio client on a private event-loop thread and blocking the caller on results, and
``init``/``get_client`` for module-level calls (``tensorcast.put(...)``). Does not own: protocol logic,
which lives once in ``client.aio``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from tensorcast.client.aio import AsyncArtifact, AsyncClient, AsyncView
from tensorcast.client.artifact import ArtifactBase
from tensorcast.client.group import GroupSwapResult
from tensorcast.client.kv import AsyncKV
from tensorcast.client.loop import LoopThread
from tensorcast.client.operation import Operation
from tensorcast.client.reads import Diagnostics
from tensorcast.client.weights_sync import Binding, WeightPublisher
from tensorcast.config import Config
from tensorcast.context import CallContext
from tensorcast.errors import InvalidArgument
from tensorcast.kv.blocks import BlockRegions
from tensorcast.kv.keys import KVLayout
from tensorcast.plans.builder import Plan, PlanOutcome
from tensorcast.records import InstanceInfo, Placement, WorkerInfo
from tensorcast.views import TP, TPRules
from tensorcast.wire.kv_messages import ShardTable
from tensorcast.wire.messages import InstanceReply, Prefetched, RunPlan

__all__ = ["Artifact", "Client", "View", "connect", "get_client", "init"]

T = TypeVar("T")


class View:
    """A lazy slice of an artifact (``Artifact.view``); the holder cuts it, so only its bytes move."""

    def __init__(self, artifact: Artifact, inner: AsyncView) -> None:
        self._artifact = artifact
        self._inner = inner

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return self._inner.tensor_names

    @property
    def view_id(self) -> str:
        """The artifact id this view has once materialized on a worker (``prefetch(tp=...)``)."""
        return self._inner.view_id

    @property
    def last_diagnostics(self) -> Diagnostics | None:
        return self._inner.last_diagnostics

    def shape(self, name: str) -> tuple[int, ...]:
        return self._inner.shape(name)

    def tensor(self, name: str | None = None, like: str = "torch", *, source: str = "auto",
               device: str = "cpu") -> Any:
        return self._artifact._sync(self._inner.tensor(name, like, source=source, device=device))

    def tensor_dict(self, like: str = "torch", *, source: str = "auto", device: str = "cpu") -> dict[str, Any]:
        """``{name: tensor}`` of this view (e.g. one rank's weights); ``device="cuda[:N]"``: on that GPU."""
        return self._artifact._sync(self._inner.tensor_dict(like, source=source, device=device))

    def tensor_dict_into(self, targets: Mapping[str, Any], *, source: str = "auto") -> None:
        self._artifact._sync(self._inner.tensor_dict_into(targets, source=source))


class Artifact(ArtifactBase):
    """An immutable set of named tensors in the pool. Materialized only on ``tensor``/``tensor_dict``."""

    def __init__(self, client: Client, inner: AsyncArtifact) -> None:
        super().__init__(inner.info)
        self._client = client
        self._inner = inner

    def _sync(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            return self._client._run(coro)
        finally:
            self.info = self._inner.info

    @property
    def last_diagnostics(self) -> Diagnostics | None:
        """How the last materialization was served: replica, tier, transport, bytes moved, time, retries."""
        return self._inner.last_diagnostics

    def tensor(self, name: str | None = None, like: str = "torch", *, source: str = "auto",
               device: str = "cpu") -> Any:
        """One tensor. Same host: a copy-on-write mapping of the pool's memory (no copy; writes stay
        private). Another host: fetched over the data plane. ``source``: auto, local_only, prefer_p2p,
        prefer_disk. ``device="cuda[:N]"`` (torch with CUDA): a same-host worker's copy on that GPU opened
        with CUDA IPC (no copy; ``prefetch(device=...)``), else the bytes copied there through pinned
        staging buffers, pipelined."""
        single = self._single_name(name)
        kept = self._inner.kept_tensors((single,), like, source, device)  # read before: no hop to the client's loop
        if kept is not None:
            return kept[single]
        return self._sync(self._inner.tensor(name, like, source=source, device=device))

    def tensor_dict(self, like: str = "torch", *, source: str = "auto", device: str = "cpu") -> dict[str, Any]:
        kept = self._inner.kept_tensors(self.tensor_names, like, source, device)
        if kept is not None:
            return kept
        return self._sync(self._inner.tensor_dict(like, source=source, device=device))

    def tensor_dict_into(self, targets: Mapping[str, Any], *, source: str = "auto") -> None:
        """Fill caller-owned tensors in place (e.g. ``model.state_dict()``)."""
        self._sync(self._inner.tensor_dict_into(targets, source=source))

    def view(self, slices: Mapping[str, Sequence[tuple[int, slice]]] | None = None, *, tp: TP | None = None,
             rules: TPRules | Mapping[str, Any] | None = None) -> View:
        """A lazy view: ``slices={name: [(dim, slice), ...]}`` or ``tp=TP(rank, world_size)`` with ``rules``."""
        return View(self, self._inner.view(slices, tp=tp, rules=rules))

    def prefetch(self, to: str, *, pin: bool = False, pin_ttl: float | None = None, timeout: float | None = None,
                 streams: int = 0, tp: TP | None = None, rules: TPRules | Mapping[str, Any] | None = None,
                 slices: Mapping[str, Sequence[tuple[int, slice]]] | None = None,
                 device: str = "") -> Operation[Prefetched]:
        """Copy the artifact into worker ``to``'s memory, worker-to-worker; with ``tp=TP(rank, world)`` only
        that rank's view (the warm path for weights); with ``device="cuda:N"`` also onto that GPU of the
        worker, for CUDA IPC hand-offs. Returns at once."""
        return Operation(self._client._loop.submit(self._inner.prefetch(
            to, pin=pin, pin_ttl=pin_ttl, timeout=timeout, streams=streams, tp=tp, rules=rules, slices=slices,
            device=device)), "prefetch")

    def evict(self, on: str) -> None:
        """Drop worker ``on``'s memory replica now (its disk copy, if any, stays)."""
        self._sync(self._inner.evict(on))

    def pin(self, on: str, ttl: float | None = None) -> Prefetched:
        """Keep a memory replica resident on worker ``on`` (copied there first if needed)."""
        return self._sync(self._inner.pin(on, ttl))

    def unpin(self, on: str) -> None:
        self._sync(self._inner.unpin(on))

    def renew(self, ttl: float) -> Artifact:
        """Extend a caller lease to ``ttl`` seconds from now."""
        self._sync(self._inner.renew(ttl))
        return self

    def release(self) -> None:
        """End a caller lease now: the artifact is deleted."""
        self._sync(self._inner.release())

    def refresh(self) -> Artifact:
        self._sync(self._inner.refresh())
        return self


class Client:
    """Synchronous client of a TensorCast cluster (connect to a gateway worker's address)."""

    def __init__(self, address: str | Sequence[str], token: str | None = None, *,
                 config: Config | None = None) -> None:
        self._loop = LoopThread()
        self.aio = AsyncClient(address, token, config=config)
        self.address = self.aio.address
        self._closed = False

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise InvalidArgument("client is closed")
        return self._loop.run(coro)

    def _wrap(self, inner: AsyncArtifact) -> Artifact:
        return Artifact(self, inner)

    def put(self, tensors: Any, key: str | None = None, *, ttl: float | None = None,
            policy: str | Placement | None = None, on: str | None = None, timeout: float | None = None,
            ctx: CallContext | None = None) -> Artifact:
        """Store a tensor or ``{name: tensor}`` as one artifact. See ``AsyncClient.put``."""
        return self._wrap(self._run(self.aio.put(tensors, key, ttl=ttl, policy=policy, on=on, timeout=timeout,
                                                 ctx=ctx)))

    def prefetch(self, key_or_id: str, to: str, *, pin: bool = False, pin_ttl: float | None = None,
                 timeout: float | None = None, streams: int = 0, tp: TP | None = None,
                 rules: TPRules | Mapping[str, Any] | None = None,
                 slices: Mapping[str, Sequence[tuple[int, slice]]] | None = None,
                 device: str = "") -> Operation[Prefetched]:
        """Make worker ``to`` hold the artifact (or a rank's view of it) in memory, worker-to-worker; returns
        at once (see ``Artifact.prefetch`` for every option)."""
        return Operation(self._loop.submit(self.aio.prefetch(
            key_or_id, to, pin=pin, pin_ttl=pin_ttl, timeout=timeout, streams=streams, tp=tp, rules=rules,
            slices=slices, device=device)), "prefetch")

    def from_disk(self, path: str | os.PathLike[str], key: str | None = None, *, verify_checksums: bool = True,
                  on: str | None = None, timeout: float | None = None) -> Artifact:
        """Register a safetensors checkpoint without reading it (see ``AsyncClient.from_disk``)."""
        return self._wrap(self._run(self.aio.from_disk(path, key, verify_checksums=verify_checksums, on=on,
                                                       timeout=timeout)))

    def artifact(self, key_or_id: str, *, timeout: float | None = None) -> Artifact:
        return self._wrap(self._run(self.aio.artifact(key_or_id, timeout=timeout)))

    def ls(self, prefix: str = "", *, limit: int | None = None) -> list[Artifact]:
        """Every artifact with a key under ``prefix`` (or the first ``limit``), paged through."""
        return [self._wrap(a) for a in self._run(self.aio.ls(prefix, limit=limit))]

    def delete(self, key_or_id: str) -> str:
        return self._run(self.aio.delete(key_or_id))

    def list_workers(self) -> list[WorkerInfo]:
        return self._run(self.aio.list_workers())

    def list_instances(self) -> list[InstanceInfo]:
        return self._run(self.aio.list_instances())

    def call_instance(self, instance_id: str, op: str, *, request_id: str = "", artifacts: Sequence[str] = (),
                      args: Mapping[str, Any] | None = None, timeout: float | None = None) -> InstanceReply:
        return self._run(self.aio.call_instance(instance_id, op, request_id=request_id, artifacts=artifacts,
                                                args=args, timeout=timeout))

    def publisher(self, model: str, *, keep_last: int = 2, policy: str | Placement | None = None,
                  on: str | None = None) -> WeightPublisher:
        """Publishes versions of ``model``; see ``AsyncClient.publisher`` and docs/weight-sync.md."""
        return WeightPublisher(self._run, self.aio.publisher(model, keep_last=keep_last, policy=policy, on=on))

    def bind(self, model: str, *, into: Any, tp: TP | None = None,
             rules: TPRules | Mapping[str, Any] | str | None = None,
             sources: Mapping[str, Sequence[str]] | None = None, staging: str = "mapped",
             holder: str | None = None, lease_ttl: float = 30.0) -> Binding:
        """Bind tensors whose addresses never change to ``model``'s versions; see ``AsyncClient.bind``."""
        return Binding(self._run, self._run(self.aio.bind(model, into=into, tp=tp, rules=rules, sources=sources,
                                                          staging=staging, holder=holder, lease_ttl=lease_ttl)))

    def group_swap(self, instances: Sequence[str], model: str, version: int | None = None, *,
                   expected: int | None = None, timeout: float | None = None,
                   fetch: str | None = None) -> GroupSwapResult:
        """Swap binding ranks together through a gateway plan; see ``AsyncClient.group_swap``."""
        return self._run(self.aio.group_swap(instances, model, version, expected=expected, timeout=timeout,
                                             fetch=fetch))

    def plan(self, ctx: CallContext | None = None) -> Plan:
        """A plan builder with one shared CallContext; ``plan.run(concurrency=k)`` returns an Operation."""
        return Plan(ctx or CallContext(), self.run_plan)

    def run_plan(self, spec: RunPlan, ctx: CallContext | None = None) -> Operation[PlanOutcome]:
        """Run a built plan (``plan.spec()``) on the gateway; returns at once."""
        return Operation(self._loop.submit(self.aio.run_plan(spec, ctx)), "plan")

    def list_shards(self) -> ShardTable:
        return self._run(self.aio.list_shards())

    def metrics_urls(self) -> dict[str, str]:
        """Where every process serves Prometheus metrics ("gs": also the dashboard), by process name."""
        return self._run(self.aio.metrics_urls())

    @property
    def kv(self) -> KV:
        """Batched KV-page operations (``put``, ``get``, ``get_into``, ``exists``)."""
        return KV(self, self.aio.kv)

    @property
    def ops(self) -> Operations:
        """Every lifecycle call as a lazy ``Operation`` (sent now, awaited with ``.result()``)."""
        return Operations(self)

    def ping(self) -> None:
        self._run(self.aio.ping())

    def close(self) -> None:
        if not self._closed:
            self._run(self.aio.close())
            self._closed = True
            self._loop.stop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(address: str | Sequence[str], token: str | None = None, *, config: Config | None = None) -> Client:
    """Connect to a cluster through a gateway worker (``HOST:PORT``, or several); raises ``Unavailable`` if
    none can be reached. The client continues through another gateway if its own goes away."""
    client = Client(address, token, config=config)
    try:
        client.ping()
    except BaseException:
        client.close()
        raise
    return client


class KV:
    """Synchronous facade of ``AsyncKV``."""

    def __init__(self, client: Client, inner: AsyncKV) -> None:
        self._client = client
        self.inner = inner

    def put(self, keys: Sequence[str], pages: Sequence[Any], *, ttl: float | None = None,
            layout: KVLayout | None = None) -> int:
        """Store pages under their keys; see ``AsyncKV.put`` (what a page is, ``layout`` checks)."""
        return self._client._run(self.inner.put(keys, pages, ttl=ttl, layout=layout))

    def get(self, keys: Sequence[str]) -> list[Any]:
        return self._client._run(self.inner.get(keys))

    def get_into(self, keys: Sequence[str], buffers: Sequence[Any], *, layout: KVLayout | None = None) -> list[bool]:
        """Receive pages straight into buffers; see ``AsyncKV.get_into`` (sizes, ``layout`` checks)."""
        return self._client._run(self.inner.get_into(keys, buffers, layout=layout))

    def exists(self, keys: Sequence[str]) -> int:
        """How many leading keys are present; see ``AsyncKV.exists``. Answered on this thread when same-host
        presence tables vouch for the keys up to the first miss (no hop to the client's event loop)."""
        n = self.inner.local_presence.exists(keys)
        return n if n is not None else self._client._run(self.inner.exists(keys))

    def present(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is present; see ``AsyncKV.present`` (answered on this thread like ``exists``)."""
        flags = self.inner.local_presence.present(keys)
        return flags if flags is not None else self._client._run(self.inner.present(keys))

    def put_blocks(self, keys: Sequence[str], blocks: Any, regions: BlockRegions, *, ttl: float | None = None) -> int:
        """Store blocks of a paged cache as pages; see ``AsyncKV.put_blocks``."""
        return self._client._run(self.inner.put_blocks(keys, blocks, regions, ttl=ttl))

    def get_blocks(self, keys: Sequence[str], blocks: Any, regions: BlockRegions) -> list[bool]:
        """Load pages into blocks of a paged cache; see ``AsyncKV.get_blocks``."""
        return self._client._run(self.inner.get_blocks(keys, blocks, regions))


class Operations:
    """``client.ops``: each lifecycle primitive started in the background, returning an ``Operation``."""

    def __init__(self, client: Client) -> None:
        self._c = client

    def _op(self, name: str, coro: Coroutine[Any, Any, T]) -> Operation[T]:
        return Operation(self._c._loop.submit(coro), name)

    async def _artifact(self, key_or_id: str) -> AsyncArtifact:
        return await self._c.aio.artifact(key_or_id)

    def put(self, tensors: Any, key: str | None = None, **kw: Any) -> Operation[Artifact]:
        async def go() -> Artifact:
            return self._c._wrap(await self._c.aio.put(tensors, key, **kw))

        return self._op("put", go())

    def get(self, key_or_id: str, like: str = "torch", *, source: str = "auto") -> Operation[dict[str, Any]]:
        async def go() -> dict[str, Any]:
            return await (await self._artifact(key_or_id)).tensor_dict(like, source=source)

        return self._op("get", go())

    def view(self, key_or_id: str, *, like: str = "torch", **view_kw: Any) -> Operation[dict[str, Any]]:
        async def go() -> dict[str, Any]:
            return await (await self._artifact(key_or_id)).view(**view_kw).tensor_dict(like)

        return self._op("view", go())

    def prefetch(self, key_or_id: str, to: str, *, pin: bool = False, pin_ttl: float | None = None,
                 timeout: float | None = None, streams: int = 0, tp: TP | None = None,
                 rules: TPRules | Mapping[str, Any] | None = None,
                 slices: Mapping[str, Sequence[tuple[int, slice]]] | None = None,
                 device: str = "") -> Operation[Prefetched]:
        return self._c.prefetch(key_or_id, to, pin=pin, pin_ttl=pin_ttl, timeout=timeout, streams=streams, tp=tp,
                                rules=rules, slices=slices, device=device)

    def pin(self, key_or_id: str, on: str, ttl: float | None = None) -> Operation[Prefetched]:
        return self._op("pin", self._c.aio.prefetch(key_or_id, on, pin=True, pin_ttl=ttl))

    def unpin(self, key_or_id: str, on: str) -> Operation[None]:
        async def go() -> None:
            await (await self._artifact(key_or_id)).unpin(on)

        return self._op("unpin", go())

    def kv_put(self, keys: Sequence[str], pages: Sequence[Any], *, ttl: float | None = None) -> Operation[int]:
        """``client.kv.put`` in the background (an engine saving pages without waiting for them); the pages'
        buffers must stay unchanged until the operation is done."""
        return self._op("kv_put", self._c.aio.kv.put(keys, pages, ttl=ttl))

    def delete(self, key_or_id: str) -> Operation[str]:
        return self._op("delete", self._c.aio.delete(key_or_id))

    def release(self, key_or_id: str) -> Operation[None]:
        async def go() -> None:
            await (await self._artifact(key_or_id)).release()

        return self._op("release", go())

    def publish(self, instance: str, request_id: str) -> Operation[InstanceReply]:
        return self._op("publish", self._c.aio.call_instance(instance, "publish", request_id=request_id))

    def hydrate(self, instance: str, request_id: str, artifacts: Sequence[str]) -> Operation[InstanceReply]:
        return self._op("hydrate", self._c.aio.call_instance(instance, "hydrate", request_id=request_id,
                                                             artifacts=artifacts))

    def transform_into(self, instance: str, artifacts: Sequence[str]) -> Operation[InstanceReply]:
        return self._op("transform_into", self._c.aio.call_instance(instance, "transform_into",
                                                                    artifacts=artifacts))


_default: Client | None = None
_default_lock = threading.Lock()


def init(address: str | None = None, token: str | None = None, *, config: Config | None = None) -> Client:
    """Set this process's default client (address from the argument or ``TENSORCAST_ADDRESS``)."""
    global _default
    address = address or os.environ.get("TENSORCAST_ADDRESS")
    if not address:
        raise InvalidArgument("tensorcast.init needs an address (or set TENSORCAST_ADDRESS)")
    with _default_lock:
        if _default is not None:
            _default.close()
        # TENSORCAST_ADDRESS may name several gateways, comma-separated.
        _default = connect([a.strip() for a in address.split(",") if a.strip()], token, config=config)
        return _default


def get_client() -> Client:
    if _default is None:
        if os.environ.get("TENSORCAST_ADDRESS"):
            return init()
        raise InvalidArgument("no default client: call tensorcast.init(address) first")
    return _default
