"""Request/response RPC over framed connections: handler registry, server and client channel.

Owns: the handshake (``Hello`` -> ``Welcome``, cluster-token check), multiplexing many requests on one
connection by request id, deadlines (a request whose absolute deadline has passed is refused with
``DeadlineExceeded`` before its handler starts; a handler still running at the deadline is cancelled),
the trace id of each request in the logging context, and turning handler exceptions into typed
``ErrorReply`` frames (and back into exceptions on the caller side). Does not own: what handlers do.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from tensorcast.checksums import ChunkCorrupted, first_bad_chunk
from tensorcast.config import WireConfig
from tensorcast.context import CallContext, set_current_trace
from tensorcast.errors import (
    DeadlineExceeded,
    InternalError,
    InvalidArgument,
    TensorCastError,
    Unauthenticated,
    clip,
    error_from_code,
)
from tensorcast.obs import metrics, tracing
from tensorcast.wire.connection import (
    HASH_OFF_LOOP_BYTES,
    Connection,
    ConnectionLost,
    Frame,
    Landing,
    NotSent,
    Sink,
    WireState,
    encode_envelope,
    error_reply,
    payload_views,
)
from tensorcast.wire.messages import PROTOCOL_VERSION, ErrorReply, Hello, Welcome
from tensorcast.wire.protocol import ERROR, REQUEST, RESPONSE, Envelope

__all__ = ["ConnectionLost", "HandlerRegistry", "NotSent", "Reply", "Request", "RpcChannel", "RpcServer",
           "parse_address"]

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


def token_refusal(expected: str | None, sent: str | None) -> str:
    """Why a handshake's token is refused ("" when it is accepted): a wrong or missing token, and also a
    token sent to a cluster that has none (a misconfigured cluster or client, never silently accepted)."""
    if expected is None:
        return "" if sent is None else "this cluster runs without a token, yet one was sent: configure the " \
                                       "cluster with it (TENSORCAST_TOKEN) or connect without one"
    if not hmac.compare_digest((sent or "").encode(), expected.encode()):
        return "wrong or missing cluster token"
    return ""


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
    ) -> None:
        self.registry = registry
        self._on_request = on_request
        self.config = config
        self.token = token
        self.welcome = Welcome(protocol_version=PROTOCOL_VERSION, server_id=server_id, host_id=host_id,
                               roles=roles)
        self._server: asyncio.Server | None = None
        self._shared = WireState(config)
        self._conns: set[Connection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.address = ""

    async def start(self, host: str, port: int) -> str:
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
        if len(self._conns) >= self.config.max_connections:
            self._shared.refusals.warning("refused a connection: %d open (wire.max_connections)", len(self._conns))
            loop.call_soon(conn.close)  # once connection_made has given it its transport
            return conn
        self._conns.add(conn)
        conn.handshake_timer = loop.call_later(self.config.handshake_timeout, self._check_handshake, conn)
        return conn

    def _check_handshake(self, conn: Connection) -> None:
        if not conn.authenticated and not conn.closed.is_set():
            conn.fail(Unauthenticated("no handshake within the timeout"))

    def _on_lost(self, conn: Connection, exc: Exception | None) -> None:
        self._conns.discard(conn)

    def _choose_sink(self, conn: Connection, env: Envelope, message: Any, size: int) -> Sink | Landing | None:
        if not conn.authenticated:
            raise Unauthenticated("payload before handshake")
        entry = self.registry.get(type(message))
        if entry is None or entry[1] is None:
            raise InvalidArgument(f"{type(message).__name__} does not take a payload")
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
        env, msg = frame.envelope, frame.message
        if not isinstance(msg, Hello):
            conn.fail(Unauthenticated("the first message must be Hello"))
            return
        if msg.protocol_version != PROTOCOL_VERSION:
            conn.fail(InvalidArgument(
                f"protocol version {msg.protocol_version} not supported (server speaks {PROTOCOL_VERSION})"))
            return
        refusal = token_refusal(self.token, msg.token)
        if refusal:
            self._shared.refusals.warning("refused a connection from %s: %s", clip(msg.peer_id or "?", 64), refusal)
            conn.fail(Unauthenticated(refusal))
            return
        conn.authenticate(msg)
        body = encode_envelope(env.request_id, RESPONSE, env.trace_id, None, self.welcome)
        self._spawn(self._send(conn, body))

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
            ctx.check(type(frame.message).__name__)
            await verify_payload(frame)
            coro = entry[0](frame.message, Request(conn, ctx, frame.payload, conn.peer,
                                                   landing.context if landing is not None else None))
            left = ctx.remaining()
            try:
                result = await (coro if left is None else asyncio.wait_for(coro, left))
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
            log.exception("handler for %s failed", type(frame.message).__name__)
            outcome = InternalError.code
            self._write_error(conn, env, InternalError(f"{type(exc).__name__}: {exc}"))
        finally:
            if landing is not None and landing.discard is not None:
                landing.discard()
            if reply is not None and reply.on_sent is not None:
                reply.on_sent()
        return outcome

    def _write_error(self, conn: Connection, env: Envelope, exc: TensorCastError) -> None:
        body = encode_envelope(env.request_id, ERROR, env.trace_id, None, error_reply(exc))
        self._spawn(self._send(conn, body))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
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


class RpcChannel:
    """A client's connection to one server, reconnecting on demand.

    ``call`` sends one request and waits for its reply; many calls may be in flight at once.
    """

    def __init__(
        self,
        address: str,
        config: WireConfig,
        *,
        token: str | None,
        peer_id: str = "",
        host_id: str = "",
        shared: WireState | None = None,
    ) -> None:
        self.address = address
        self.config = config
        self.hello = Hello(protocol_version=PROTOCOL_VERSION, token=token, peer_id=peer_id, host_id=host_id)
        self.welcome: Welcome | None = None
        self._shared = shared or WireState(config)
        self._conn: Connection | None = None
        self._connecting: asyncio.Lock | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[asyncio.Future[Frame], ReplySink | None]] = {}

    async def connect(self, ctx: CallContext | None = None) -> Welcome:
        """Open the connection (or reuse it) and handshake; bounded by the handshake timeout and by
        ``ctx``'s deadline, whichever comes first."""
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        limit = CallContext(deadline=time.time() + self.config.handshake_timeout)
        if ctx is not None and ctx.deadline is not None and ctx.deadline < (limit.deadline or 0):
            limit = ctx
        async with self._connecting:
            if self._conn is not None and not self._conn.closed.is_set():
                assert self.welcome is not None
                return self.welcome
            host, port = parse_address(self.address)
            loop = asyncio.get_running_loop()
            left = min(self.config.connect_timeout, max(limit.remaining() or 0.0, 0.001))
            try:
                _, conn = await asyncio.wait_for(
                    loop.create_connection(
                        lambda: Connection(self.config, self._on_frame, self._choose_sink, self._on_lost,
                                           self._shared),
                        host, port),
                    left,
                )
            except TimeoutError:
                if limit is ctx:
                    raise DeadlineExceeded(f"connecting to {self.address}: deadline exceeded",
                                           trace_id=ctx.trace_id) from None
                raise NotSent(f"cannot connect to {self.address}: timed out") from None
            except OSError as exc:
                raise NotSent(f"cannot connect to {self.address}: {exc}") from None
            try:
                frame = await self._roundtrip(conn, self.hello, limit, None, None)
                if not isinstance(frame.message, Welcome):
                    raise InvalidArgument(f"unexpected handshake reply {type(frame.message).__name__}")
            except BaseException:
                conn.close()
                raise
            conn.authenticate(frame.message)
            self._conn = conn
            self.welcome = frame.message
            return frame.message

    async def call(
        self,
        message: Any,
        ctx: CallContext,
        *,
        payload: Sink | None = None,
        sink: ReplySink | None = None,
    ) -> Frame:
        """Send ``message`` and return the reply frame; raise the typed error the server reported."""
        method = type(message).__name__
        ctx.check(method)
        started = time.perf_counter()
        outcome = "ok"
        try:
            with tracing.span(method, ctx.trace_id, kind="client", attributes={"peer": self.address}):
                await self.connect(ctx)
                assert self._conn is not None
                return await self._roundtrip(self._conn, message, ctx, payload, sink)
        except TensorCastError as exc:
            outcome = exc.code
            raise
        finally:
            metrics.rpc_sent(method, self._peer_kind(), outcome, time.perf_counter() - started)

    def _peer_kind(self) -> str:
        """gs, instance or worker (the roles the peer announced), for metrics."""
        roles = self.welcome.roles if self.welcome is not None else ()
        return "gs" if "gs" in roles else "instance" if "instance" in roles else "worker" if roles else "unknown"

    async def _roundtrip(
        self,
        conn: Connection,
        message: Any,
        ctx: CallContext,
        payload: Sink | None,
        sink: ReplySink | None,
    ) -> Frame:
        request_id = next(self._ids)
        fut: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = (fut, sink)
        try:
            body = encode_envelope(request_id, REQUEST, ctx.trace_id, ctx.deadline, message, tracing.current_span_id())
            left = ctx.remaining()
            try:
                async with asyncio.timeout(left):
                    await conn.send(body, payload)
                    frame = await fut
            except TimeoutError:
                raise DeadlineExceeded(f"{type(message).__name__} to {self.address}: deadline exceeded",
                                       trace_id=ctx.trace_id) from None
        finally:
            self._pending.pop(request_id, None)
        if frame.envelope.kind == ERROR:
            err = frame.message
            if isinstance(err, ErrorReply):
                raise error_from_code(err.code, err.message, ctx.trace_id)
            raise InternalError("malformed error reply", trace_id=ctx.trace_id)
        if frame.error is not None:
            raise frame.error
        await verify_payload(frame)
        return frame

    def _choose_sink(self, conn: Connection, env: Envelope, message: Any, size: int) -> Sink | None:
        entry = self._pending.get(env.request_id)
        if entry is None or entry[1] is None or env.kind == ERROR:
            return None
        sink = entry[1]
        return sink(message) if callable(sink) else sink

    def _on_frame(self, conn: Connection, frame: Frame) -> None:
        env = frame.envelope
        entry = self._pending.get(env.request_id)
        if entry is not None:
            if not entry[0].done():
                entry[0].set_result(frame)
            return
        if env.request_id == 0 and env.kind == ERROR and isinstance(frame.message, ErrorReply):
            # A connection-level error (the server is about to close): fail everything in flight.
            exc = error_from_code(frame.message.code, frame.message.message)
            for fut, _ in list(self._pending.values()):
                if not fut.done():
                    fut.set_exception(exc)

    def _on_lost(self, conn: Connection, exc: Exception | None) -> None:
        for fut, _ in list(self._pending.values()):
            if not fut.done():
                fut.set_exception(ConnectionLost(f"connection to {self.address} lost"))

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
