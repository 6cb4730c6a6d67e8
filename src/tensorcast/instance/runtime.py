"""The instance runtime an engine process starts: registration, load heartbeats, instance operations.

Owns: ``serve(adaptor, worker=..., instance_id=...)`` — an RPC endpoint (on its own event-loop thread)
that the gateway calls for ``publish``/``hydrate``/``transform_into``/engine commands; registering with
the home worker (which records the instance at the global store); heartbeating the adaptor's load; and
moving tensors between the adaptor and the pool (publish stores a caller-leased artifact on the home
worker; hydrate/transform_into read artifacts, zero-copy when they are on this host); and lending the adaptor
its client's KV-page calls (an adaptor with a ``bind_kv`` method gets an ``EngineKV``, for prefix reuse).
Does not own: the engine (the adaptor) or routing (the gateway).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from tensorcast.client.aio import AsyncClient
from tensorcast.client.kv import AsyncKV
from tensorcast.client.loop import LoopThread
from tensorcast.config import Config
from tensorcast.context import CallContext
from tensorcast.credentials import check_bind
from tensorcast.errors import InvalidArgument, NotFound, TensorCastError, clip
from tensorcast.instance.adaptor import InstanceAdaptor
from tensorcast.instance.announce import announce
from tensorcast.kv.keys import KVLayout
from tensorcast.obs import metrics, tracing
from tensorcast.obs.http import HttpServer
from tensorcast.obs.metrics import Sample
from tensorcast.records import InstanceInfo
from tensorcast.wire.messages import InstanceCall, InstanceReply, RegisterInstance
from tensorcast.wire.rpc import HandlerRegistry, Request, RpcServer

__all__ = ["EngineKV", "InstanceRuntime", "serve"]

log = logging.getLogger("tensorcast.instance")


class EngineKV:
    """The runtime client's KV-page calls, made synchronously from the engine thread (adaptor calls run on a
    worker thread while the runtime's event loop is free): one client and one connection per instance."""

    def __init__(self, kv: AsyncKV, loop: LoopThread) -> None:
        self._kv, self._loop = kv, loop

    def exists(self, keys: Sequence[str]) -> int:
        return self._loop.run(self._kv.exists(keys))

    def get(self, keys: Sequence[str]) -> list[Any]:
        return self._loop.run(self._kv.get(keys))

    def get_into(self, keys: Sequence[str], buffers: Sequence[Any], *, layout: KVLayout | None = None) -> list[bool]:
        return self._loop.run(self._kv.get_into(keys, buffers, layout=layout))

    def put(self, keys: Sequence[str], pages: Sequence[Any], *, ttl: float | None = None,
            layout: KVLayout | None = None) -> int:
        return self._loop.run(self._kv.put(keys, pages, ttl=ttl, layout=layout))


class InstanceRuntime:
    def __init__(self, adaptor: InstanceAdaptor, worker: str, instance_id: str, *, token: str | None = None,
                 config: Config | None = None, host: str = "127.0.0.1", port: int = 0,
                 publish_ttl: float = 600.0, heartbeat_interval: float = 0.5) -> None:
        self.adaptor = adaptor
        self.worker_address = worker
        self.instance_id = instance_id
        self.config = config or Config.load()
        self.token = token if token is not None else self.config.token
        self.host, self.port = host, port
        self.publish_ttl = publish_ttl
        self.heartbeat_interval = heartbeat_interval
        self.address = ""
        self.home_worker = ""
        self._engine_lock = threading.Lock()  # engines are single-threaded: one adaptor call at a time
        self._loop = LoopThread("tensorcast-instance")
        self._client: AsyncClient | None = None
        self._server: RpcServer | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._http = HttpServer(self.token, tls=self.config.tls, allowed_hosts=self.config.metrics.allowed_hosts) \
            if self.config.metrics.enabled else None
        self.metrics_url = ""
        self._source: int | None = None

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> InstanceRuntime:
        """Attach to the worker and serve. Without a token, only on loopback (its RPC port and its metrics)."""
        check_bind(self.host, self.token, f"instance {self.instance_id}")
        if self._http is not None:
            check_bind(self.config.metrics.host or self.host, self.token, "the metrics endpoint (metrics.host)")
        self._loop.run(self._start())
        return self

    async def _start(self) -> None:
        self._client = AsyncClient(self.worker_address, self.token, config=self.config)
        welcome = await self._client.caller.connect()
        self.home_worker = welcome.server_id
        bind_kv = getattr(self.adaptor, "bind_kv", None)
        if callable(bind_kv):  # optional: engines that reuse KV pages (e.g. the HF adaptor's prefix reuse)
            bind_kv(EngineKV(self._client.kv, self._loop))
        registry = HandlerRegistry()
        registry.register(InstanceCall, self._handle)
        self._server = RpcServer(registry, self.config.wire, token=self.token, server_id=self.instance_id,
                                 host_id=self._client.host_id, roles=("instance",), tls=self.config.tls)
        self.address = await self._server.start(self.host, self.port)
        metrics.set_enabled(self.config.metrics.enabled)
        if self._http is not None:
            self.metrics_url = await self._http.start(self.config.metrics.host or self.host, self.config.metrics.port)
            self._source = metrics.add_source(self._samples)
        tracing.configure(self.config.tracing, f"tensorcast-instance-{self.instance_id}", roots=False)
        info = self._info()  # registered now: an instance the global store refuses does not start
        await self._client.caller.call(RegisterInstance(instance=info), CallContext().with_timeout(10))
        self._heartbeat = asyncio.ensure_future(announce(self._client, info, self.heartbeat_interval,
                                                         self.adaptor.load, registered=True))
        log.info("instance %s (%s) serving at %s, home worker %s", self.instance_id, self.adaptor.engine,
                 self.address, self.home_worker)

    def _info(self) -> InstanceInfo:
        load = self.adaptor.load()
        return InstanceInfo(instance_id=self.instance_id, address=self.address, home_worker=self.home_worker,
                            running=load.running, waiting=load.waiting, kv_tokens_used=load.kv_tokens_used,
                            kv_tokens_capacity=load.kv_tokens_capacity, engine=self.adaptor.engine,
                            metrics_url=self.metrics_url)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._loop.run(self._stop())
        self._loop.stop()

    def _samples(self) -> Iterator[Sample]:
        load = self.adaptor.load()
        i = {"instance": self.instance_id}
        yield Sample("tensorcast_instance_requests", "Requests an engine instance holds, by state (the load "
                     "signal of list_instances()).", {**i, "state": "running"}, load.running)
        yield Sample("tensorcast_instance_requests", "", {**i, "state": "waiting"}, load.waiting)
        yield Sample("tensorcast_instance_kv_tokens", "KV-cache tokens of an engine instance, used and capacity.",
                     {**i, "state": "used"}, load.kv_tokens_used)
        yield Sample("tensorcast_instance_kv_tokens", "", {**i, "state": "capacity"}, load.kv_tokens_capacity)

    async def _stop(self) -> None:
        if self._http is not None:
            await self._http.close()
        if self._source is not None:
            metrics.remove_source(self._source)
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self._server is not None:
            await self._server.close()
        if self._client is not None:
            await self._client.close()

    def __enter__(self) -> InstanceRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ----------------------------------------------------------------- operations
    async def _engine(self, fn: Any, *args: Any) -> Any:
        def locked() -> Any:
            with self._engine_lock:
                return fn(*args)

        return await asyncio.to_thread(locked)

    async def _tensors(self, artifacts: tuple[str, ...]) -> dict[str, Any]:
        assert self._client is not None
        merged: dict[str, Any] = {}
        for aid in artifacts:
            art = await self._client.artifact(aid)
            merged.update(await art.tensor_dict(like="torch"))
        return merged

    async def _handle(self, msg: InstanceCall, req: Request) -> InstanceReply:
        if msg.instance_id != self.instance_id:
            raise NotFound(f"this is instance {self.instance_id}, not {msg.instance_id}")
        assert self._client is not None
        options: Mapping[str, Any] = msg.args
        if msg.op == "publish":
            tensors = await self._engine(self.adaptor.publish, msg.request_id, options)
            art = await self._client.put(dict(tensors), key=f"kv/{self.instance_id}/{msg.request_id}",
                                         ttl=float(options.get("ttl", self.publish_ttl)), ctx=req.ctx)
            return InstanceReply(artifacts=(art.id,))
        if msg.op == "hydrate":
            tensors = await self._tensors(msg.artifacts)
            await self._engine(self.adaptor.hydrate, msg.request_id, tensors, options)
            return InstanceReply()
        if msg.op == "transform_into":
            tensors = await self._tensors(msg.artifacts)
            await self._engine(self.adaptor.transform_into, tensors, options)
            return InstanceReply()
        if msg.op == "engine":
            command = options.get("command")
            if not isinstance(command, str):
                raise InvalidArgument("engine calls need args['command']")
            return InstanceReply(result=await self._engine(self.adaptor.engine_command, command, options))
        raise InvalidArgument(f"unknown instance operation {clip(msg.op)}")


def serve(adaptor: InstanceAdaptor, worker: str, instance_id: str, **kwargs: Any) -> InstanceRuntime:
    """Attach an engine to TensorCast: register ``instance_id`` with the worker at ``worker`` (its home),
    heartbeat its load, and serve instance operations. Returns the started runtime (``stop()`` it)."""
    deadline = time.time() + 30
    while True:
        try:
            return InstanceRuntime(adaptor, worker, instance_id, **kwargs).start()
        except TensorCastError:
            if time.time() > deadline:
                raise
            time.sleep(0.2)
