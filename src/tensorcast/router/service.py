"""``tensorcast router``: an OpenAI-compatible HTTP service in front of N engine servers (``vllm serve``).

Owns: the routes (``POST /v1/completions`` and ``/v1/chat/completions``, streaming and not; ``GET /v1/models``,
``/health``, ``/metrics``), forwarding a request to the backend its policy chose (``router.choice``) with the body
and headers as they came, and the answer back as it arrives: a streamed answer is written to the client chunk by
chunk as the backend sends it, never buffered; each backend's requests in flight (the load the policies see);
backends found in the cluster as they announce themselves (``router.discovery``: added to the pool, then up or down
by their health); health (a backend that refuses a connection is marked down and the request goes to another one, as
long as nothing of the answer was sent; a background check brings it back when its ``/health`` answers, and reads
the load the engine reports on its ``/metrics``); prefill/decode disaggregation (a prefill pool computes each prompt
for one token and stores its KV pages; the request then goes to the decode pool with the prefill's
``kv_transfer_params``, and the decode instance loads those pages: the ``TensorCastConnector`` protocol, which
``examples/pd_proxy.py`` shows alone); and the router's metrics (requests by backend and outcome, the routing
decision's time, in flight); and, for ``event-cache-aware``, the KV events of the engines and of the pool's shard
homes applied as they arrive (on a thread: ``router.event_thread``), each backend's home worker and the pool's
workers read from the cluster with every health check (an instance is credited with what a shard home on its host
holds), and text prompts tokenized by a backend (``/tokenize``) so that they match the events' token blocks; and
the rebalancer's ticks (the sessions this replica saw and its moves among them: ``router.session_book``).

aiohttp (``pip install 'tensorcast[router]'``) on one event loop: a decision is microseconds of Python, forwarding
is a pass-through of the backend's bytes. Does not own: the policies (``tensorcast.policies``), or the engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tensorcast.errors import InvalidArgument, Unavailable
from tensorcast.policies import EventFeed, Rebalancer, Request, Router
from tensorcast.router.backend_calls import probe, prompt_tokens
from tensorcast.router.choice import BackendLoad, as_instances, route_view, wants_tokens
from tensorcast.router.discovery import Discovery, adopt, backend_urls, home_workers
from tensorcast.router.event_thread import EventThread
from tensorcast.router.session_book import SessionBook

__all__ = ["RouterService"]

log = logging.getLogger("tensorcast.router")
_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}  # not forwarded as they came
_MAX_BODY = 64 * 1024**2


class RouterService:
    """The service: ``start()`` listens, ``stop()`` closes; ``backends`` are base URLs (``http://host:port``)."""

    def __init__(self, backends: Sequence[str], policy: Router, *, host: str = "127.0.0.1", port: int = 0,
                 session_header: str = "x-session-id", health_interval: float = 2.0,
                 request_timeout: float = 600.0, prefill: Sequence[str] = (),
                 prefill_policy: Router | None = None, feed: EventFeed | None = None,
                 rebalancer: Rebalancer | None = None, discovery: Discovery | None = None) -> None:
        """``request_timeout``: seconds a backend may stay silent (before its first byte, or between two).
        ``prefill``: disaggregated mode: each request's prompt first on one of these (``prefill_policy``),
        then the request on one of ``backends`` (the decode pool) with the prefill's ``kv_transfer_params``.
        ``feed``: the engines' and the pool's KV events (for ``event-cache-aware``), applied on a thread as they
        come (with ``discovery``, the feed also follows the pool's shard homes); a text prompt is then tokenized by
        a backend (``POST /tokenize``) so that it matches their blocks.
        ``rebalancer``: every ``interval_s`` it may move idle sessions off the most loaded backend
        (``router.session_book``); a moved session's requests then go to its new backend. ``discovery``: more
        backends, found in the cluster's ``list_instances()`` at start and with every health check (unless it
        only reads the cluster: ``adds_backends`` False); either way each backend's home worker, and the pool's
        workers for the policy (``Router.set_topology``) and the feed."""
        if not backends and (discovery is None or not discovery.adds_backends):
            raise InvalidArgument("the router needs at least one backend URL, or a cluster to discover them in")
        self.backends = [BackendLoad(f"b{i}", u.rstrip("/")) for i, u in enumerate(backends)]
        self.prefill = [BackendLoad(f"p{i}", u.rstrip("/")) for i, u in enumerate(prefill)]
        if self.prefill and prefill_policy is None:
            raise InvalidArgument("a prefill pool needs its own policy (prefill_policy)")
        self.prefill_policy = prefill_policy or policy
        self.policy = policy
        self.host, self.port = host, port
        self.session_header = session_header.lower()
        self.health_interval = health_interval
        self.request_timeout = request_timeout
        self.registry = CollectorRegistry()
        self._requests = Counter("tensorcast_router_requests", "Requests forwarded, by backend and outcome",
                                 ["backend", "outcome"], registry=self.registry)
        self._decide = Histogram("tensorcast_router_decision_seconds", "Time to choose a backend",
                                 buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3), registry=self.registry)
        self._moves = Counter("tensorcast_router_session_moves", "Sessions the rebalancer moved",
                              registry=self.registry)
        self._in_flight = Gauge("tensorcast_router_in_flight", "Requests in flight", ["backend"],
                                registry=self.registry)
        self._first_byte = Histogram("tensorcast_router_first_byte_seconds", "From forwarding a request to the "
                                     "backend's first byte of answer (a streamed answer's first chunk: its TTFT)",
                                     ["backend"], buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                                     registry=self.registry)
        self.feed = feed
        self._events = EventThread(feed) if feed is not None else None
        self.discovery = discovery
        self._found: set[str] = set()  # URLs discovery added
        self._ids = itertools.count(len(self.backends))  # backend ids stay unique as discovered ones come and go
        self.book = SessionBook(rebalancer)
        self._ticks: asyncio.Task[None] | None = None
        self._runner: Any = None
        self._session: Any = None
        self._health: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

        app = web.Application(client_max_size=_MAX_BODY)
        app.router.add_post("/v1/completions", self._forward)
        app.router.add_post("/v1/chat/completions", self._forward)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health_route)
        app.router.add_get("/metrics", self._metrics)
        self._session = ClientSession(connector=TCPConnector(limit=0, keepalive_timeout=30),
                                      timeout=ClientTimeout(total=None, sock_connect=5,
                                                            sock_read=self.request_timeout))
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])  # the port bound (port 0: one the system chose)
        if self._events is not None:
            self._events.start()
        await self._discover()
        self._health = asyncio.create_task(self._check_health())
        if self.book.rebalancer is not None:
            self._ticks = asyncio.create_task(self._rebalance())
        log.info("router on %s: %d backends%s", self.url, len(self.backends),
                 f", {len(self.prefill)} prefill" if self.prefill else "")

    async def stop(self) -> None:
        for task in (self._health, self._ticks):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._events is not None:
            await asyncio.to_thread(self._events.stop)
        if self.discovery is not None:
            await self.discovery.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    # ----------------------------------------------------------------- routes
    async def _forward(self, request: Any) -> Any:
        raw = await request.read()
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("not an object")
        except (ValueError, UnicodeDecodeError) as exc:
            return _error(400, f"the request body is not a JSON object ({exc.__class__.__name__})")
        view = route_view(body, request.headers.get(self.session_header, ""))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        if self.feed is not None and wants_tokens(body):  # engines' events name token blocks, not text
            view = Request(view.session_id, await prompt_tokens(self._session, self.backends, body) or view.prompt)
        if self.prefill:  # disaggregated: the prompt on a prefill backend, its KV handed over through the pool
            params = await self._prefill_leg(request.path, body, view, headers)
            if not isinstance(params, dict):
                return params  # the prefill pool's error, as the client's answer
            raw = json.dumps({**body, "kv_transfer_params": params}).encode()
        return await self._relay(request, raw, view, headers)

    def _pick(self, pool: list[BackendLoad], policy: Router, view: Any, tried: set[str]) -> BackendLoad:
        """The backend ``policy`` picks among those of ``pool`` not tried yet (``Unavailable``: none left); a
        session the rebalancer moved goes where it moved (the decode pool)."""
        t0 = time.perf_counter()
        candidates = as_instances([b for b in pool if b.backend_id not in tried],
                                  self.book.resident if pool is self.backends else None)
        chosen = self.book.override(view.session_id, [i for i in candidates if i.alive]) \
            if pool is self.backends else None
        if not chosen:  # a session the rebalancer moved goes where it moved; any other, where the policy says
            with self._index_lock():
                chosen = policy.route(view, candidates)
        self._decide.observe(time.perf_counter() - t0)
        tried.add(chosen)
        return next(b for b in pool if b.backend_id == chosen)

    @contextlib.contextmanager
    def _counted(self, backend: BackendLoad) -> Iterator[None]:
        backend.in_flight += 1
        self._in_flight.labels(backend.backend_id).inc()
        try:
            yield
        finally:
            backend.in_flight -= 1
            self._in_flight.labels(backend.backend_id).dec()

    @contextlib.contextmanager
    def _session_done(self, session_id: str) -> Iterator[None]:
        try:
            yield
        finally:
            self.book.finished(time.monotonic(), session_id)

    async def _rebalance(self) -> None:
        """Every rebalancer tick: its moves, logged and counted."""
        assert self.book.rebalancer is not None
        interval = self.book.rebalancer.interval_s
        while True:
            await asyncio.sleep(max(interval, 0.05))
            for m in self.book.rebalance(time.monotonic(), as_instances(self.backends, self.book.resident)):
                self._moves.inc()
                log.info("moved session %s from %s to %s (%d tokens of context)", m.session_id, m.source, m.target,
                         m.kv_tokens)

    def _failed(self, backend: BackendLoad, exc: BaseException) -> None:
        self._requests.labels(backend.backend_id, "failed").inc()
        backend.alive = False
        log.warning("backend %s (%s) failed: %s; trying another", backend.backend_id, backend.url, exc)

    async def _relay(self, request: Any, raw: bytes, view: Any, headers: dict[str, str]) -> Any:
        """The request to a backend of the (decode) pool and its answer back as it arrives."""
        from aiohttp import ClientError, web

        tried: set[str] = set()
        while True:
            try:
                backend = self._pick(self.backends, self.policy, view, tried)
            except Unavailable as exc:
                return _error(503, str(exc))
            response: web.StreamResponse | None = None
            self.book.started(time.monotonic(), view.session_id, backend.backend_id, len(view.prompt))
            with self._counted(backend), self._session_done(view.session_id):
                try:
                    sent = time.perf_counter()
                    async with self._session.post(backend.url + request.path, data=raw, headers=headers) as up:
                        if up.content_length is not None and up.content_type != "text/event-stream":
                            # A whole answer of a known size: one write (a stream is never held back).
                            answer = web.Response(status=up.status, body=await up.read(),
                                                  headers=_passed(up.headers))
                            self._first_byte.labels(backend.backend_id).observe(time.perf_counter() - sent)
                            self._requests.labels(backend.backend_id, str(up.status)).inc()
                            return answer
                        response = web.StreamResponse(status=up.status, headers=_passed(up.headers))
                        await response.prepare(request)
                        first = True
                        async for chunk in up.content.iter_any():  # as it arrives: streaming is not buffered
                            if first:
                                self._first_byte.labels(backend.backend_id).observe(time.perf_counter() - sent)
                                first = False
                            await response.write(chunk)
                        await response.write_eof()
                        self._requests.labels(backend.backend_id, str(up.status)).inc()
                        return response
                except (ClientError, OSError) as exc:
                    if response is not None:  # part of the answer went out: the client sees the cut
                        self._requests.labels(backend.backend_id, "failed").inc()
                        raise
                    self._failed(backend, exc)

    async def _prefill_leg(self, path: str, body: dict[str, Any], view: Any, headers: dict[str, str]) -> Any:
        """One token of the request on a prefill backend, which computes the prompt and stores its KV pages;
        returns its ``kv_transfer_params`` for the decode leg (which loads those pages), or the error answer."""
        from aiohttp import ClientError, web

        leg = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {}}
        if "max_completion_tokens" in body:
            leg["max_completion_tokens"] = 1
        leg.pop("stream_options", None)
        tried: set[str] = set()
        while True:
            try:
                backend = self._pick(self.prefill, self.prefill_policy, view, tried)
            except Unavailable as exc:
                return _error(503, f"prefill: {exc}")
            with self._counted(backend):
                try:
                    async with self._session.post(backend.url + path, json=leg, headers=headers) as up:
                        answer = await up.read()
                        self._requests.labels(backend.backend_id, str(up.status)).inc()
                        if up.status != 200:
                            return web.Response(status=up.status, body=answer, content_type="application/json")
                    doc = json.loads(answer)
                    params = doc.get("kv_transfer_params") if isinstance(doc, dict) else None
                    return dict(params) if isinstance(params, dict) else {}  # none: the decode side recomputes
                except (ClientError, OSError) as exc:
                    self._failed(backend, exc)
                except ValueError:
                    return _error(502, f"prefill backend {backend.backend_id} answered something not JSON")

    def _index_lock(self) -> Any:
        """Held around a decision that may read the KV event index (changed on the event thread)."""
        return self.feed.lock if self.feed is not None else contextlib.nullcontext()

    async def _models(self, request: Any) -> Any:
        from aiohttp import ClientError, web

        for backend in [b for b in self.backends if b.alive] or self.backends:
            try:
                async with self._session.get(backend.url + "/v1/models") as up:
                    return web.Response(status=up.status, body=await up.read(), content_type="application/json")
            except (ClientError, OSError):
                backend.alive = False
        return _error(503, "no backend answered /v1/models")

    async def _health_route(self, request: Any) -> Any:
        from aiohttp import web

        up = [b.backend_id for b in [*self.backends, *self.prefill] if b.alive]
        serving = any(b.alive for b in self.backends) and (not self.prefill or any(b.alive for b in self.prefill))
        return web.json_response({"backends": len(self.backends) + len(self.prefill), "alive": up},
                                 status=200 if serving else 503)

    async def _metrics(self, request: Any) -> Any:
        from aiohttp import web

        return web.Response(body=generate_latest(self.registry), content_type="text/plain")

    async def _check_health(self) -> None:
        """Every ``health_interval``: what the cluster says (``_discover``), then every backend probed (up or
        down, the load it reports: ``router.backend_calls.probe``)."""
        while True:
            await self._discover()
            await asyncio.gather(*(probe(self._session, b) for b in [*self.backends, *self.prefill]))
            await asyncio.sleep(self.health_interval)

    async def _discover(self) -> None:
        """What the cluster says now: its workers to the policies and the event thread, each backend's home
        worker, and (``adds_backends``) the backends it lists that this router does not know yet, added (up:
        their records are alive; their health checks follow), discovered ones gone from the list and down,
        dropped. Unreachable cluster: everything known stays as it is."""
        if self.discovery is None:
            return
        try:
            instances, workers = await self.discovery.survey()
        except Exception as exc:  # whatever it is, health checks go on: they run on the same task
            log.warning("cannot list the cluster's instances (%s: %s); keeping the %d backends known",
                        type(exc).__name__, exc, len(self.backends))
            return
        try:
            with self._index_lock():
                self.policy.set_topology(workers)
                if self.prefill_policy is not self.policy:
                    self.prefill_policy.set_topology(workers)
            if self._events is not None:
                self._events.follow(workers, self.discovery.host_id)
            if self.discovery.adds_backends:
                adopt(self.backends, backend_urls(instances, self.discovery.engine), self._found,
                      lambda: f"b{next(self._ids)}")
            homes = home_workers(instances)
            for b in [*self.backends, *self.prefill]:
                b.home_worker = homes.get(b.url, b.home_worker)
        except Exception:  # a policy's own set_topology, say: health checks go on (they run on this task)
            log.exception("applying what the cluster said failed; keeping the backends known")


def _passed(headers: Any) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _HOP and k.lower() != "content-encoding"}


def _error(status: int, message: str) -> Any:
    """An OpenAI-style error body."""
    from aiohttp import web

    kind = "invalid_request_error" if status < 500 else "service_unavailable"
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)
