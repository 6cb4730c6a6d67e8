"""Request/response RPC over framed connections, the server side: handler registry and server.

Owns: TLS on accepted connections (``tls.enabled``), the handshake's frames (``Hello`` -> ``Challenge`` ->
``Proof`` -> ``Welcome``, decided by ``wire.handshake``), each request's role check (``REQUIRED_ROLE``:
``PermissionDenied`` before the handler runs), multiplexing many requests on one connection by request id,
deadlines (a request whose absolute deadline has passed is refused with ``DeadlineExceeded`` before its
handler starts; a handler still running at the deadline is cancelled), the trace id of each request in the
logging context, and turning handler exceptions into typed ``ErrorReply`` frames. Does not own: what
handlers do, or the caller's side (``wire.channel``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from asyncio import sslproto
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from tensorcast.checksums import ChunkCorrupted, first_bad_chunk
from tensorcast.config import TLSConfig, WireConfig
from tensorcast.context import CallContext, set_current_trace
from tensorcast.credentials import Keyring, allows, check_bind
from tensorcast.errors import (
    DeadlineExceeded,
    InternalError,
    InvalidArgument,
    PermissionDenied,
    TensorCastError,
    Unauthenticated,
    clip,
)
from tensorcast.obs import metrics, tracing
from tensorcast.tls import server_context
from tensorcast.wire.connection import (
    HASH_OFF_LOOP_BYTES,
    Connection,
    ConnectionLost,
    Frame,
    Landing,
    NotSent,
    Sink,
    encode_envelope,
    error_reply,
    payload_views,
)
from tensorcast.wire.handshake import ServerHandshake
from tensorcast.wire.messages import PROTOCOL_VERSION, Hello, Proof, Welcome
from tensorcast.wire.protocol import ERROR, REQUEST, RESPONSE, Envelope, required_role
from tensorcast.wire.shared import WireState, has_bytes_waiting

__all__ = ["ConnectionLost", "HandlerRegistry", "NotSent", "Reply", "Request", "RpcServer", "parse_address",
           "verify_payload"]

log = logging.getLogger("tensorcast.rpc")


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise InvalidArgument(f"address must be HOST:PORT, got {address!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


@dataclass(slots=True)
class Request:
    """What a handler sees besides its message."""

    conn: Connection | None  # None when a handler is invoked in-process (a gateway running a plan step)
    ctx: CallContext
    payload: Sink | None
    peer: Hello | None
    landing: Any = None  # the context its sink returned with the payload's destination (``Landing``)


@dataclass(slots=True)
class Reply:
    message: Any
    payload: Sink | None = None
    # Called after the reply (and its payload) was written, e.g. to release a read lease.
    on_sent: Callable[[], None] | None = None


Handler = Callable[[Any, Request], Awaitable[Any]]
# Where a request's payload goes: a buffer, several buffers, a Landing (buffers plus what the handler needs
# and how to give them back if the request fails), or None for a fresh buffer.
SinkFn = Callable[[Any, Connection], Sink | Landing | None]
# Where a reply's payload goes: a buffer, several buffers, or a function of the reply message choosing them.
ReplySink = Sink | Callable[[Any], Sink]


class HandlerRegistry:
    """Message type -> handler (and, for messages that carry a payload, where to put it)."""

    def __init__(self) -> None:
        self._handlers: dict[type, tuple[Handler, SinkFn | None]] = {}

    def register(self, msg_type: type, handler: Handler, sink: SinkFn | None = None) -> None:
        if msg_type in self._handlers:
            raise ValueError(f"handler for {msg_type.__name__} already registered")
        self._handlers[msg_type] = (handler, sink)

    def get(self, msg_type: type) -> tuple[Handler, SinkFn | None] | None:
        return self._handlers.get(msg_type)

    def types(self) -> frozenset[type]:
        """The message types served."""
        return frozenset(self._handlers)

    async def dispatch(self, msg: Any, ctx: CallContext) -> Any:
        """Run ``msg``'s handler in process (a request this process sends itself) and return its reply."""
        entry = self._handlers.get(type(msg))
        if entry is None:
            raise InvalidArgument(f"{type(msg).__name__} is not served here")
        reply = await entry[0](msg, Request(conn=None, ctx=ctx, payload=None, peer=None))
        return reply.message if isinstance(reply, Reply) else reply


class RpcServer:
    def __init__(
        self,
        registry: HandlerRegistry,
        config: WireConfig,
        *,
        token: str | None,
        server_id: str,
        host_id: str,
        roles: tuple[str, ...] = (),
        on_request: Callable[[Any], None] | None = None,
        tls: TLSConfig | None = None,
    ) -> None:
        self.registry = registry
        self._on_request = on_request
        self.config = config
        self.token = token
        self.keyring = Keyring.from_token(token)
        self._tls = server_context(tls) if tls is not None else None
        self.welcome = Welcome(protocol_version=PROTOCOL_VERSION, server_id=server_id, host_id=host_id,
                               roles=roles)
        self._server: asyncio.Server | None = None
        self._shared = WireState(config)
        self._conns: dict[Connection, None] = {}  # in accept order
        self._tasks: set[asyncio.Task[None]] = set()
        self.address = ""

    async def start(self, host: str, port: int) -> str:
        check_bind(host, self.token, f"the RPC port of {self.welcome.server_id or 'a server'}")
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._make_conn, host, port)
        sock_host, sock_port = self._server.sockets[0].getsockname()[:2]
        self.address = f"{sock_host}:{sock_port}"
        return self.address

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            conn.close()
        for task in list(self._tasks):
            task.cancel()
        if self._server is not None:
            await self._server.wait_closed()

    def _make_conn(self) -> Connection:
        conn = Connection(self.config, self._on_frame, self._choose_sink, self._on_lost, self._shared)
        loop = asyncio.get_running_loop()
        waiting = [c for c in self._conns if not c.authenticated]  # in accept order (a dict-ordered set)
        if len(waiting) >= self.config.max_unauthenticated:  # the oldest silent one makes room
            self._shared.refusals.warning("closed the oldest unauthenticated connection: %d are waiting "
                                          "(wire.max_unauthenticated)", len(waiting))
            victim = next((c for c in waiting if not c.heard and not _bytes_waiting(c)), waiting[0])  # silent first
            self._conns.pop(victim, None)
            victim.close()
        if len(self._conns) >= self.config.max_connections:
            self._shared.refusals.warning("refused a connection: %d open (wire.max_connections)", len(self._conns))
            loop.call_soon(conn.close)  # once connection_made has given it its transport
            return conn
        self._conns[conn] = None
        conn.handshake = ServerHandshake(self.keyring, self.welcome.server_id, "rpc")
        conn.handshake_timer = loop.call_later(self.config.handshake_timeout, self._check_handshake, conn)
        if self._tls is not None:
            conn.on_made = self._made
        return conn

    def _made(self, conn: Connection) -> None:
        """The accepted connection has its transport: first the plain one, which TLS is put over before a byte
        is read from it (an ``SSLProtocol`` between the socket and the connection, as ``loop.start_tls`` does);
        then, once the TLS handshake is done, the TLS one. A connection still negotiating TLS counts against
        the same caps and the same handshake timeout as any that has not authenticated, and can be closed."""
        if conn.tls_pending:
            conn.tls_pending = False  # TLS is up: from here the connection reads and writes through it
            return
        assert self._tls is not None and conn.transport is not None
        loop = asyncio.get_running_loop()
        raw, waiter = conn.transport, loop.create_future()
        # (whole seconds; the connection's own handshake timer closes it on time in any case)
        tls = sslproto.SSLProtocol(loop, conn, self._tls, waiter, server_side=True,
                                   ssl_handshake_timeout=max(1, math.ceil(self.config.handshake_timeout)))
        conn.tls_pending = True
        raw.set_protocol(tls)
        tls.connection_made(raw)
        self._spawn(self._tls_outcome(conn, raw, waiter))

    async def _tls_outcome(self, conn: Connection, raw: asyncio.Transport, waiter: asyncio.Future[None]) -> None:
        """A TLS handshake that failed (or timed out, or was cut off) is logged, and its connection forgotten:
        asyncio tells the connection nothing of it."""
        try:
            await waiter
            why = "closed"
        except (OSError, ConnectionError) as exc:  # ssl.SSLError is an OSError
            why = getattr(exc, "reason", None) or type(exc).__name__
        if not conn.tls_pending:
            return  # up
        peer = raw.get_extra_info("peername")
        self._shared.refusals.warning("refused a connection from %s: TLS handshake failed (%s)",
                                      peer[0] if peer else "?", why)
        raw.close()
        if not conn.closed.is_set():
            conn.connection_lost(None)

    def _check_handshake(self, conn: Connection) -> None:
        if not conn.authenticated and not conn.closed.is_set():
            conn.fail(Unauthenticated("no handshake within the timeout"))

    def _on_lost(self, conn: Connection, exc: Exception | None) -> None:
        self._conns.pop(conn, None)

    def _choose_sink(self, conn: Connection, env: Envelope, message: Any, size: int) -> Sink | Landing | None:
        if not conn.authenticated:
            raise Unauthenticated("payload before handshake")
        entry = self.registry.get(type(message))
        if entry is None or entry[1] is None:
            raise InvalidArgument(f"{type(message).__name__} does not take a payload")
        self._check_role(conn, message, env)  # before anything is reserved for the payload
        view = entry[1](message, conn)
        if view is None or isinstance(view, list | Landing):
            return view
        if len(view) < size:
            raise InvalidArgument(f"payload of {size} bytes overruns its {len(view)}-byte destination")
        return view[:size]

    def _on_frame(self, conn: Connection, frame: Frame) -> None:
        env = frame.envelope
        if env.kind != REQUEST:
            conn.fail(InvalidArgument("server expects requests only"))
            return
        if not conn.authenticated:
            self._handshake(conn, frame)
            return
        if self._on_request is not None:
            self._on_request(frame.message)
        self._spawn(self._handle(conn, frame))

    def _handshake(self, conn: Connection, frame: Frame) -> None:
        """``Hello`` (answered with a ``Challenge``, or with ``Welcome`` on a cluster without a token), then
        ``Proof`` (answered with ``Welcome``); anything else, or a refusal, closes the connection."""
        env, msg = frame.envelope, frame.message
        hs: ServerHandshake = conn.handshake
        try:
            if isinstance(msg, Hello):
                if msg.protocol_version != PROTOCOL_VERSION:
                    conn.fail(InvalidArgument(f"protocol version {msg.protocol_version} not supported (server "
                                              f"speaks {PROTOCOL_VERSION})"))
                    return
                conn.peer = msg
                challenge = hs.hello(msg.role, msg.nonce, msg.peer_id)
                reply: Any = challenge if challenge is not None else self._welcome(conn)
            elif isinstance(msg, Proof) and isinstance(conn.peer, Hello):
                hs.answer(msg.proof)
                reply = self._welcome(conn)
            else:
                raise Unauthenticated("the first message must be Hello")
        except Unauthenticated as exc:
            who = clip(conn.peer.peer_id if isinstance(conn.peer, Hello) else "?", 64)
            self._shared.refusals.warning("refused a connection from %s: %s", who, exc.message)
            conn.fail(exc)
            return
        self._spawn(self._send(conn, encode_envelope(env.request_id, RESPONSE, env.trace_id, None, reply)))

    def _welcome(self, conn: Connection) -> Welcome:
        conn.authenticate(conn.peer)
        conn.role, conn.handshake = conn.handshake.role, None
        return self.welcome

    async def _handle(self, conn: Connection, frame: Frame) -> None:
        env = frame.envelope
        set_current_trace(env.trace_id)
        method = type(frame.message).__name__
        started = time.perf_counter()
        outcome = "ok"
        try:
            with tracing.span(f"serve {method}", env.trace_id, env.span_id, "server"):
                outcome = await self._serve(conn, frame)
        finally:
            metrics.rpc_served(method, outcome, time.perf_counter() - started)

    async def _serve(self, conn: Connection, frame: Frame) -> str:
        """Run the request's handler and send its reply or error; returns "ok" or the error's code."""
        env = frame.envelope
        outcome = "ok"
        reply: Reply | None = None
        landing = frame.landing
        try:
            ctx = CallContext(trace_id=env.trace_id, deadline=env.deadline)  # a NaN deadline: InvalidArgument
            if frame.error is not None:
                raise frame.error
            entry = self.registry.get(type(frame.message))
            if entry is None:
                raise InvalidArgument(f"{type(frame.message).__name__} is not served here")
            self._check_role(conn, frame.message, env)
            ctx.check(type(frame.message).__name__)
            await verify_payload(frame)
            coro = entry[0](frame.message, Request(conn, ctx, frame.payload, conn.peer,
                                                   landing.context if landing is not None else None))
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for wraps the handler in a task of its own
                async with asyncio.timeout(ctx.remaining()):
                    result = await coro
            except TimeoutError:
                raise DeadlineExceeded(f"{type(frame.message).__name__}: deadline passed while running",
                                       trace_id=env.trace_id) from None
            landing = None  # the handler took the payload's destination over
            reply = result if isinstance(result, Reply) else Reply(result)
            body = encode_envelope(env.request_id, RESPONSE, env.trace_id, None, reply.message)
            await conn.send(body, reply.payload)
        except TensorCastError as exc:
            outcome = exc.code
            self._write_error(conn, env, exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._shared.bugs.exception("handler for %s failed", type(frame.message).__name__)
            outcome = InternalError.code
            self._write_error(conn, env, InternalError(f"{type(exc).__name__}: {exc}"))
        finally:
            if landing is not None and landing.discard is not None:
                landing.discard()
            if reply is not None and reply.on_sent is not None:
                reply.on_sent()
        return outcome

    @staticmethod
    def _check_role(conn: Connection, message: Any, env: Envelope) -> None:
        needed = required_role(message)
        if not allows(conn.role, needed):
            raise PermissionDenied(f"{type(message).__name__} needs a {needed} credential; this connection's is "
                                   f"{conn.role}", trace_id=env.trace_id)

    def _write_error(self, conn: Connection, env: Envelope, exc: TensorCastError) -> None:
        body = encode_envelope(env.request_id, ERROR, env.trace_id, None, error_reply(exc))
        self._spawn(self._send(conn, body))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)  # keep a reference until done
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _send(conn: Connection, body: bytes) -> None:
        with contextlib.suppress(TensorCastError):
            await conn.send(body)


async def verify_payload(frame: Frame) -> None:
    """Check a received payload against the checksums it came with (``ChunkCorrupted`` on a mismatch:
    nothing of it may be used; a retry may succeed)."""
    if frame.payload is None or frame.checksums is None:
        return
    views = payload_views(frame.payload)
    size = sum(v.nbytes for v in views)
    bad = first_bad_chunk(views, frame.checksums) if size < HASH_OFF_LOOP_BYTES else \
        await asyncio.to_thread(first_bad_chunk, views, frame.checksums)
    if bad is not None:
        raise ChunkCorrupted(f"{type(frame.message).__name__}: payload chunk {bad} failed its checksum",
                             trace_id=frame.envelope.trace_id)


def _bytes_waiting(conn: Connection) -> bool:
    """Whether the peer of a connection not yet read from has sent something (``has_bytes_waiting``)."""
    sock = conn.transport.get_extra_info("socket") if conn.transport is not None else None
    return sock is not None and has_bytes_waiting(sock.fileno())
