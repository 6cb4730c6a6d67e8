"""The HTTP endpoint of a TensorCast process: ``/metrics`` for Prometheus, ``/healthz``, and the routes a role
adds (the global store's dashboard).

Owns: a small asyncio HTTP/1.1 server on the process's event loop (GET and HEAD only, one request per
connection, bounded request size and time), authentication (with a cluster token configured, every request
but ``/healthz`` must carry it: ``Authorization: Bearer TOKEN`` or basic auth with the token as password;
refused with 401 otherwise, nothing else is read), and routing. Does not own: what the routes return.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from tensorcast.obs import metrics

__all__ = ["HttpServer", "Response", "Route"]

log = logging.getLogger("tensorcast.http")

# A request line and headers beyond this are refused (the server reads nothing else).
_MAX_HEAD_BYTES = 16 * 1024
_HEAD_TIMEOUT = 10.0


@dataclass(frozen=True)
class Response:
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    status: int = 200


Route = Callable[[str], Awaitable[Response]]  # the query string -> the response

_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            500: "Internal Server Error", 503: "Service Unavailable"}


class HttpServer:
    def __init__(self, token: str | None = None, routes: dict[str, Route] | None = None,
                 before_scrape: Callable[[], Awaitable[None]] | None = None) -> None:
        self.token = token
        self._before_scrape = before_scrape
        self.routes: dict[str, Route] = {"/metrics": self._metrics, "/healthz": self._health, **(routes or {})}
        self._server: asyncio.Server | None = None
        self.url = ""

    async def start(self, host: str, port: int) -> str:
        self._server = await asyncio.start_server(self._serve, host, port, limit=_MAX_HEAD_BYTES)
        sock_host, sock_port = self._server.sockets[0].getsockname()[:2]
        shown = f"[{sock_host}]" if ":" in sock_host else sock_host
        self.url = f"http://{shown}:{sock_port}"
        return self.url

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def _metrics(self, query: str) -> Response:
        if self._before_scrape is not None:
            await self._before_scrape()  # state read asynchronously, then reported by the sources
        return Response(metrics.exposition(), "text/plain; version=0.0.4; charset=utf-8")

    @staticmethod
    async def _health(query: str) -> Response:
        return Response(b"ok\n")

    def _authorized(self, headers: dict[str, str]) -> bool:
        if self.token is None:
            return True
        scheme, _, value = headers.get("authorization", "").partition(" ")
        sent = ""
        if scheme.lower() == "bearer":
            sent = value.strip()
        elif scheme.lower() == "basic":
            with contextlib.suppress(ValueError):
                sent = base64.b64decode(value.strip(), validate=True).decode("utf-8", "replace").partition(":")[2]
        return hmac.compare_digest(sent.encode(), self.token.encode())

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(_HEAD_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
            response, method = await self._respond(head)
        except (asyncio.LimitOverrunError, asyncio.IncompleteReadError, TimeoutError, ConnectionError):
            response, method = Response(b"bad request\n", status=400), "GET"
        except Exception:
            log.exception("HTTP request failed")
            response, method = Response(b"internal error\n", status=500), "GET"
        extra = 'WWW-Authenticate: Basic realm="tensorcast"\r\n' if response.status == 401 else ""
        status = f"HTTP/1.1 {response.status} {_REASONS.get(response.status, 'Error')}\r\n"
        writer.write(f"{status}Content-Type: {response.content_type}\r\nContent-Length: {len(response.body)}\r\n"
                     f"Cache-Control: no-store\r\n{extra}Connection: close\r\n\r\n".encode())
        if method != "HEAD":
            writer.write(response.body)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    async def _respond(self, head: bytes) -> tuple[Response, str]:
        if len(head) > _MAX_HEAD_BYTES:
            return Response(b"request too large\n", status=400), "GET"
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3:
            return Response(b"bad request line\n", status=400), "GET"
        method, target, _version = parts
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        url = urlsplit(target)
        if url.path != "/healthz" and not self._authorized(headers):  # liveness tells nothing: open to probes
            return Response(b"a cluster token is required\n", status=401), method
        if method not in ("GET", "HEAD"):
            return Response(b"only GET and HEAD\n", status=405), method
        route = self.routes.get(url.path)
        if route is None:
            return Response(b"not found\n", status=404), method
        return await route(url.query), method
