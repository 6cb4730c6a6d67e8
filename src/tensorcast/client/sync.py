"""The synchronous caller SDK: ``Client``, plus the process-default client.

Owns: running the asyncio client on a private event-loop thread and blocking the caller on results (each
public ``AsyncClient`` method has a twin with the same parameters), and ``init``/``get_client`` for
module-level calls (``tensorcast.put(...)``). Re-exports the sync handles (``client.sync_handles``) and the
``kv``/``ops`` facades (``client.sync_ops``). Does not own: protocol logic, which lives once in ``client.aio``
and ``client.handles``.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, TypeVar, Unpack

from tensorcast.client.aio import AsyncArtifact, AsyncClient
from tensorcast.client.artifact import Deletion, PrefetchOptions
from tensorcast.client.group import GroupSwapResult
from tensorcast.client.loop import LoopThread
from tensorcast.client.operation import Operation
from tensorcast.client.sync_handles import Artifact, View
from tensorcast.client.sync_ops import KV, Operations
from tensorcast.client.thread_calls import ThreadCalls
from tensorcast.client.weights_sync import Binding, WeightPublisher
from tensorcast.config import Config
from tensorcast.context import CallContext
from tensorcast.errors import InvalidArgument
from tensorcast.plans.builder import Plan, PlanOutcome
from tensorcast.records import InstanceInfo, Placement, WorkerInfo
from tensorcast.views import TP, TPRules
from tensorcast.wire.kv_messages import ShardTable
from tensorcast.wire.messages import GetArtifact, InstanceReply, Prefetched, RunPlan

__all__ = ["KV", "Artifact", "Client", "Operations", "View", "connect", "get_client", "init"]

T = TypeVar("T")


class Client:
    """Synchronous client of a TensorCast cluster (connect to a gateway worker's address)."""

    def __init__(self, address: str | Sequence[str], token: str | None = None, *,
                 config: Config | None = None) -> None:
        self._loop = LoopThread()
        self.aio = AsyncClient(address, token, config=config)
        self.address = self.aio.address
        self._closed = False
        self._threads = ThreadCalls(self.aio.caller, enabled=self.aio.config.client.thread_lookups)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._submit(coro).result()

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if self._closed:
            coro.close()
            raise InvalidArgument("client is closed")
        return self._loop.submit(coro)

    def _wrap(self, inner: AsyncArtifact) -> Artifact:
        return Artifact(self._run, self._submit, inner)

    def put(self, tensors: Any, key: str | None = None, *, ttl: float | None = None,
            policy: str | Placement | None = None, on: str | None = None, timeout: float | None = None,
            ctx: CallContext | None = None) -> Artifact:
        """Store a tensor or ``{name: tensor}`` as one artifact. See ``AsyncClient.put``."""
        return self._wrap(self._run(self.aio.put(tensors, key, ttl=ttl, policy=policy, on=on, timeout=timeout,
                                                 ctx=ctx)))

    def prefetch(self, key_or_id: str, to: str, **options: Unpack[PrefetchOptions]) -> Operation[Prefetched]:
        """Make worker ``to`` hold the artifact (or a rank's view of it) in memory, worker-to-worker; returns
        at once (every option: ``PrefetchOptions``)."""
        return Operation(self._submit(self.aio.prefetch(key_or_id, to, **options)), "prefetch")

    def from_disk(self, path: str | os.PathLike[str], key: str | None = None, *, verify_checksums: bool = True,
                  on: str | None = None, timeout: float | None = None) -> Artifact:
        """Register a safetensors checkpoint without reading it (see ``AsyncClient.from_disk``)."""
        return self._wrap(self._run(self.aio.from_disk(path, key, verify_checksums=verify_checksums, on=on,
                                                       timeout=timeout)))

    def artifact(self, key_or_id: str, *, timeout: float | None = None) -> Artifact:
        return self.lookup(key_or_id, timeout=timeout)

    def lookup(self, key_or_id: str, *, timeout: float | None = None, to_read: bool = True) -> Artifact:
        """``artifact``; ``to_read=False``: a handle that will not be read (see ``AsyncClient.lookup``). Sent on
        the caller's thread (``client.thread_calls``), through the client's loop when that cannot be."""
        if self._closed:
            raise InvalidArgument("client is closed")
        msg, ctx = self.aio.lookup_request(key_or_id, timeout=timeout, to_read=to_read)
        # (On the client's own loop thread, the loop's way says that a synchronous call cannot be made there.)
        reply = None if threading.current_thread() is self._loop.thread else self._threads.call(msg, ctx)
        if reply is not None:
            return self._wrap(self.aio.looked_up(key_or_id, reply))
        return self._wrap(self._run(self._lookup_on_loop(key_or_id, msg, ctx)))

    async def _lookup_on_loop(self, key_or_id: str, msg: GetArtifact, ctx: CallContext) -> AsyncArtifact:
        return self.aio.looked_up(key_or_id, await self.aio.caller.call(msg, ctx))

    def ls(self, prefix: str = "", *, limit: int | None = None) -> list[Artifact]:
        """One handle per key under ``prefix`` (with none: every key, then artifacts without a key), or the
        first ``limit``, paged through; see ``AsyncClient.ls``."""
        return [self._wrap(a) for a in self._run(self.aio.ls(prefix, limit=limit))]

    def delete(self, key_or_id: str) -> Deletion:
        """By key: unbind that key (the content goes with its last reference). By id: delete the content
        with every key. Returns the id (a ``Deletion``: ``removed``, ``keys``); see ``AsyncClient.delete``."""
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
        return Operation(self._submit(self.aio.run_plan(spec, ctx)), "plan")

    def list_shards(self) -> ShardTable:
        return self._run(self.aio.list_shards())

    def metrics_urls(self) -> dict[str, str]:
        """Where every process serves Prometheus metrics ("gs": also the dashboard), by process name."""
        return self._run(self.aio.metrics_urls())

    @property
    def kv(self) -> KV:
        """Batched KV-page operations (``put``, ``get``, ``get_into``, ``exists``)."""
        return KV(self._run, self.aio.kv)

    @property
    def ops(self) -> Operations:
        """Every lifecycle call as a lazy ``Operation`` (sent now, awaited with ``.result()``)."""
        return Operations(self.aio, self._submit, self._wrap)

    def ping(self) -> None:
        self._run(self.aio.ping())

    def close(self) -> None:
        if not self._closed:
            self._threads.close()
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
