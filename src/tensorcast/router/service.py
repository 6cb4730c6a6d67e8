"""``tensorcast router``: an OpenAI-compatible HTTP service in front of N engine servers (``vllm serve``).

Owns: the routes (``POST /v1/completions`` and ``/v1/chat/completions``, streaming and not; ``GET /v1/models``,
``/health``, ``/metrics``), forwarding a request to the backend its policy chose (``router.choice``) with the
body and headers as they came, and the answer back as it arrives: a streamed answer is written to the client
chunk by chunk as the backend sends it, never buffered; each backend's requests in flight (the load the
policies see); health (a backend that refuses a connection is marked down and the request goes to another
one, as long as nothing of the answer was sent; a background check brings it back when its ``/health``
answers); and the router's metrics (requests by backend and outcome, the routing decision's time, in flight).

aiohttp (``pip install 'tensorcast[router]'``) on one event loop: a decision is microseconds of Python,
forwarding is a pass-through of the backend's bytes. Does not own: the policies (``tensorcast.policies``),
or the engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tensorcast.errors import InvalidArgument, Unavailable
from tensorcast.policies import Router
from tensorcast.router.choice import BackendLoad, as_instances, route_view

__all__ = ["RouterService"]

log = logging.getLogger("tensorcast.router")
_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}  # not forwarded as they came
_ROUTED = ("/v1/completions", "/v1/chat/completions")
_MAX_BODY = 64 * 1024**2


class RouterService:
    """The service: ``start()`` listens, ``stop()`` closes; ``backends`` are base URLs (``http://host:port``)."""

    def __init__(self, backends: Sequence[str], policy: Router, *, host: str = "127.0.0.1", port: int = 0,
                 session_header: str = "x-session-id", health_interval: float = 2.0,
                 request_timeout: float = 600.0) -> None:
        """``request_timeout``: seconds a backend may stay silent (before its first byte, or between two)."""
        if not backends:
            raise InvalidArgument("the router needs at least one backend URL")
        self.backends = [BackendLoad(f"b{i}", u.rstrip("/")) for i, u in enumerate(backends)]
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
        self._in_flight = Gauge("tensorcast_router_in_flight", "Requests in flight", ["backend"],
                                registry=self.registry)
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
        self._health = asyncio.create_task(self._check_health())
        log.info("router on %s: %d backends", self.url, len(self.backends))

    async def stop(self) -> None:
        if self._health is not None:
            self._health.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    # ----------------------------------------------------------------- routes
    async def _forward(self, request: Any) -> Any:
        from aiohttp import ClientError, web

        raw = await request.read()
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("not an object")
        except (ValueError, UnicodeDecodeError) as exc:
            return _error(400, f"the request body is not a JSON object ({exc.__class__.__name__})")
        view = route_view(body, request.headers.get(self.session_header, ""))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        tried: set[str] = set()
        while True:
            t0 = time.perf_counter()
            candidates = [b for b in self.backends if b.backend_id not in tried]
            try:
                chosen_id = self.policy.route(view, as_instances(candidates))
            except Unavailable as exc:
                return _error(503, str(exc))
            self._decide.observe(time.perf_counter() - t0)
            backend = next(b for b in self.backends if b.backend_id == chosen_id)
            tried.add(chosen_id)
            backend.in_flight += 1
            self._in_flight.labels(chosen_id).inc()
            response: web.StreamResponse | None = None
            try:
                async with self._session.post(backend.url + request.path, data=raw, headers=headers) as up:
                    response = web.StreamResponse(status=up.status, headers=_passed(up.headers))
                    await response.prepare(request)
                    async for chunk in up.content.iter_any():  # as it arrives: streaming is not buffered
                        await response.write(chunk)
                    await response.write_eof()
                    self._requests.labels(chosen_id, str(up.status)).inc()
                    return response
            except (ClientError, OSError) as exc:
                self._requests.labels(chosen_id, "failed").inc()
                if response is not None:  # part of the answer went out: the client sees the cut
                    raise
                backend.alive = False
                log.warning("backend %s (%s) failed: %s; trying another", chosen_id, backend.url, exc)
            finally:
                backend.in_flight -= 1
                self._in_flight.labels(chosen_id).dec()

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

        up = [b.backend_id for b in self.backends if b.alive]
        return web.json_response({"backends": len(self.backends), "alive": up}, status=200 if up else 503)

    async def _metrics(self, request: Any) -> Any:
        from aiohttp import web

        return web.Response(body=generate_latest(self.registry), content_type="text/plain")

    async def _check_health(self) -> None:
        """Every ``health_interval``: each backend's ``GET /health`` decides whether it is up."""
        from aiohttp import ClientError, ClientTimeout

        while True:
            for b in self.backends:
                try:
                    async with self._session.get(b.url + "/health", timeout=ClientTimeout(total=5)) as up:
                        alive = up.status == 200
                except (TimeoutError, ClientError, OSError):
                    alive = False
                if alive != b.alive:
                    log.warning("backend %s (%s) is %s", b.backend_id, b.url, "up" if alive else "down")
                b.alive = alive
            await asyncio.sleep(self.health_interval)


def _passed(headers: Any) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _HOP and k.lower() != "content-encoding"}


def _error(status: int, message: str) -> Any:
    """An OpenAI-style error body."""
    from aiohttp import web

    kind = "invalid_request_error" if status < 500 else "service_unavailable"
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)
