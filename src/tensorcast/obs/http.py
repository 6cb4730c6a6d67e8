"""The HTTP endpoint of a TensorCast process: ``/metrics`` for Prometheus, ``/healthz``, and the routes a role
adds (the global store's dashboard).

Owns: a small asyncio HTTP/1.1 server on the process's event loop (GET and HEAD only, one request per
connection, bounded request size and time; HTTPS with ``tls.enabled``, without asking for a client
certificate), authentication (with a cluster token configured, every request but ``/healthz`` must carry a
credential of any role, or the cluster secret: ``Authorization: Bearer CREDENTIAL`` or basic auth with it as
the password; refused with 401 otherwise, nothing else is read), and routing. It listens beyond loopback only
with a token (``credentials.check_bind``). Without a token, a request must name this server in its ``Host``
header (a loopback name, the bound address, or one of ``metrics.allowed_hosts``), else 421: a web page whose
name an attacker re-points at 127.0.0.1 (DNS rebinding) must not read a token-less cluster's state. Every
response carries ``Content-Security-Policy``, ``X-Content-Type-Options: nosniff`` and ``Referrer-Policy:
no-referrer``. Does not own: what the routes return.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from tensorcast.config import TLSConfig
from tensorcast.credentials import Keyring, check_bind
from tensorcast.obs import metrics
from tensorcast.tls import http_context

__all__ = ["HttpServer", "Response", "Route"]

log = logging.getLogger("tensorcast.http")

# A request line and headers beyond this are refused (the server reads nothing else).
_MAX_HEAD_BYTES = 16 * 1024
_HEAD_TIMEOUT = 10.0


# Nothing a response of ours needs a browser to load, run or frame; an HTML route widens it (``csp``).
_DEFAULT_CSP = "default-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
# Names a token-less server answers to besides the address it is bound to.
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "localhost.localdomain", "ip6-localhost"})


@dataclass(frozen=True)
class Response:
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    status: int = 200
    csp: str = _DEFAULT_CSP


def host_name(header: str) -> str:
    """The name in a ``Host`` header (``name``, ``name:port``, ``[v6]:port``), lower case, no trailing dot."""
    value = header.strip().lower()
    if value.startswith("["):
        name = value[1 : value.find("]")] if "]" in value else value[1:]
    elif value.count(":") == 1:
        name = value.partition(":")[0]
    else:
        name = value
    return name.rstrip(".")


Route = Callable[[str], Awaitable[Response]]  # the query string -> the response

_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            421: "Misdirected Request", 500: "Internal Server Error", 503: "Service Unavailable"}


class HttpServer:
    def __init__(self, token: str | None = None, routes: dict[str, Route] | None = None,
                 before_scrape: Callable[[], Awaitable[None]] | None = None, tls: TLSConfig | None = None,
                 allowed_hosts: tuple[str, ...] = ()) -> None:
        self.token = token
        self.allowed_hosts = set(_LOOPBACK_NAMES) | {host_name(h) for h in allowed_hosts}
        self.keyring = Keyring.from_token(token)
        self._tls = http_context(tls) if tls is not None else None
        self._before_scrape = before_scrape
        self.routes: dict[str, Route] = {"/metrics": self._metrics, "/healthz": self._health, **(routes or {})}
        self._server: asyncio.Server | None = None
        self.url = ""

    async def start(self, host: str, port: int) -> str:
        check_bind(host, self.token, "the metrics endpoint (metrics.host)")
        self._server = await asyncio.start_server(self._serve, host, port, limit=_MAX_HEAD_BYTES, ssl=self._tls,
                                                  ssl_handshake_timeout=_HEAD_TIMEOUT if self._tls else None)
        sock_host, sock_port = self._server.sockets[0].getsockname()[:2]
        self.allowed_hosts |= {host_name(host), host_name(sock_host)} - {"", "0.0.0.0", "::"}
        shown = f"[{sock_host}]" if ":" in sock_host else sock_host
        self.url = f"{'https' if self._tls is not None else 'http'}://{shown}:{sock_port}"
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
        if self.keyring is None:
            return True
        scheme, _, value = headers.get("authorization", "").partition(" ")
        sent = ""
        if scheme.lower() == "bearer":
            sent = value.strip()
        elif scheme.lower() == "basic":
            with contextlib.suppress(ValueError):
                sent = base64.b64decode(value.strip(), validate=True).decode("utf-8", "replace").partition(":")[2]
        return self.keyring.verify_presented(sent) is not None

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
                     f"Cache-Control: no-store\r\nContent-Security-Policy: {response.csp}\r\n"
                     "X-Content-Type-Options: nosniff\r\nReferrer-Policy: no-referrer\r\n"
                     f"{extra}Connection: close\r\n\r\n".encode())
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
        if self.keyring is None and url.path != "/healthz" and "host" in headers \
                and host_name(headers["host"]) not in self.allowed_hosts:
            # A browser always sends Host: one naming another site reached us by DNS rebinding.
            return Response(b"this server does not answer to that Host (metrics.allowed_hosts)\n", status=421), method
        if url.path != "/healthz" and not self._authorized(headers):  # liveness tells nothing: open to probes
            return Response(b"a cluster token is required\n", status=401), method
        if method not in ("GET", "HEAD"):
            return Response(b"only GET and HEAD\n", status=405), method
        route = self.routes.get(url.path)
        if route is None:
            return Response(b"not found\n", status=404), method
        return await route(url.query), method
