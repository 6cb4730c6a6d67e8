"""What the router's tests share: ``Backend``, a small OpenAI-speaking server (aiohttp) standing for an engine,
and helpers to run a ``RouterService`` in front of some."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from tensorcast.policies import Router  # noqa: E402
from tensorcast.router import RouterService  # noqa: E402


class Backend:
    """An OpenAI-speaking server that answers with its own name; a streamed answer waits on ``gate``
    between its first and second chunk."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.bodies: list[dict[str, Any]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.runner: web.AppRunner | None = None
        self.url = ""
        self.running = 0.0  # what its /metrics reports (vLLM's series)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/tokenize", self.tokenize)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "tiny"}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def tokenize(self, request: web.Request) -> web.Response:  # words "w<id>" are token ids
        body = await request.json()
        return web.json_response({"tokens": [int(w[1:]) for w in str(body.get("prompt", "")).split()]})

    async def metrics(self, request: web.Request) -> web.Response:
        lines = [f'vllm:num_requests_running{{model_name="tiny"}} {self.running}',
                 'vllm:num_requests_waiting{model_name="tiny"} 0.0']
        return web.Response(text="\n".join(["# HELP vllm:num_requests_running ...", *lines]) + "\n")

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.name.startswith("p"):  # a prefill instance: the prompt computed, its pages named
            return web.json_response({"backend": self.name, "kv_transfer_params": {"tensorcast_pages": 3}})
        if not body.get("stream"):
            return web.json_response({"backend": self.name, "path": request.path, "echo": body})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(f"data: {json.dumps({'backend': self.name, 'part': 1})}\n\n".encode())
        await self.gate.wait()
        await out.write(f"data: {json.dumps({'backend': self.name, 'part': 2})}\n\ndata: [DONE]\n\n".encode())
        await out.write_eof()
        return out

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


def dead_url() -> str:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@asynccontextmanager
async def running(policy: Router, n: int = 2, extra: tuple[str, ...] = (),
                  **kw: Any) -> AsyncIterator[tuple[RouterService, list[Backend], Any]]:
    backends = [Backend(f"b{i}") for i in range(n)]
    for b in backends:
        await b.start()
    service = RouterService([*(b.url for b in backends), *extra], policy, **kw)
    await service.start()
    session = aiohttp.ClientSession()
    try:
        yield service, backends, session
    finally:
        await session.close()
        await service.stop()
        for b in backends:
            await b.stop()


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 60))


async def complete(session: Any, service: Any, body: dict[str, Any], **headers: str) -> dict[str, Any]:
    async with session.post(service.url + "/v1/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        return dict(await r.json())
