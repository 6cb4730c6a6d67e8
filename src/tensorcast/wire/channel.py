"""Request/response RPC, the caller's side: one connection to one server, reconnecting on demand.

Owns: opening the connection (TCP, then TLS when ``tls.enabled``: the server's certificate checked against
``tls.ca_file`` and the name dialled or ``tls.server_name``), the caller's handshake (``Hello``, then the
``Proof`` that answers the server's ``Challenge``, ``wire.handshake``), multiplexing many calls on it by
request id, each call's deadline, and turning error frames back into the typed exceptions the server
reported. Does not own: which server to call (``wire.caller``) or the server's side (``wire.rpc``).
"""

from __future__ import annotations

import asyncio
import itertools
import ssl
import time
from typing import Any

from tensorcast.config import TLSConfig, WireConfig
from tensorcast.context import CallContext
from tensorcast.credentials import Keyring
from tensorcast.errors import DeadlineExceeded, InvalidArgument, TensorCastError, error_from_code
from tensorcast.obs import metrics, tracing
from tensorcast.tls import client_context, handshake_error, server_hostname
from tensorcast.wire.connection import Connection, ConnectionLost, Frame, NotSent, Sink, encode_envelope
from tensorcast.wire.frame_parts import reported_error
from tensorcast.wire.handshake import ClientHandshake
from tensorcast.wire.messages import PROTOCOL_VERSION, Challenge, ErrorReply, Hello, Proof, Welcome
from tensorcast.wire.protocol import ERROR, REQUEST, Envelope
from tensorcast.wire.rpc import ReplySink, parse_address, verify_payload
from tensorcast.wire.shared import WireState

__all__ = ["RpcChannel"]


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
        tls: TLSConfig | None = None,
    ) -> None:
        self.address = address
        self.config = config
        self.keyring = Keyring.from_token(token)
        self.peer_id, self.host_id = peer_id, host_id
        self.tls = tls
        self.welcome: Welcome | None = None
        self._shared = shared or WireState(config)
        self._conn: Connection | None = None
        self._connecting: asyncio.Lock | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[asyncio.Future[Frame], ReplySink | None]] = {}

    async def connect(self, ctx: CallContext | None = None) -> Welcome:
        """Open the connection (or reuse it) and handshake; bounded by the handshake timeout and by
        ``ctx``'s deadline, whichever comes first."""
        if self._conn is not None and self.welcome is not None and not self._conn.closed.is_set():
            return self.welcome  # the common case, before the lock: every call comes here
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        limit = CallContext(deadline=time.time() + self.config.handshake_timeout)
        if ctx is not None and ctx.deadline is not None and ctx.deadline < (limit.deadline or 0):
            limit = ctx
        async with self._connecting:
            if self._conn is not None and not self._conn.closed.is_set():
                assert self.welcome is not None
                return self.welcome
            conn = await self._open(limit, ctx)
            try:
                welcome = await self._handshake(conn, limit)
            except ConnectionLost:  # nothing but the handshake was sent: any request may go elsewhere
                conn.close()
                raise NotSent(f"{self.address} closed the connection during the handshake: is it a TensorCast "
                              "server, speaking TLS as this process does (tls.enabled), and does it want a client "
                              "certificate (tls.cert_file)?") from None
            except BaseException:
                conn.close()
                raise
            conn.authenticate(welcome)
            self._conn = conn
            self.welcome = welcome
            return welcome

    async def _open(self, limit: CallContext, ctx: CallContext | None) -> Connection:
        """A TCP connection (TLS over it when configured), within ``limit``."""
        host, port = parse_address(self.address)
        loop = asyncio.get_running_loop()
        left = min(self.config.connect_timeout, max(limit.remaining() or 0.0, 0.001))
        tls = client_context(self.tls) if self.tls is not None else None
        extra: dict[str, Any] = {}
        if tls is not None and self.tls is not None:
            extra = {"ssl": tls, "server_hostname": server_hostname(self.tls, host), "ssl_handshake_timeout": left}
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: Connection(self.config, self._on_frame, self._choose_sink, self._on_lost, self._shared),
                    host, port, **extra),
                left,
            )
        except TimeoutError:
            if limit is ctx and ctx is not None:
                raise DeadlineExceeded(f"connecting to {self.address}: deadline exceeded",
                                       trace_id=ctx.trace_id) from None
            raise NotSent(f"cannot connect to {self.address}: timed out") from None
        except OSError as exc:  # ssl.SSLError included: a certificate that does not verify, a peer without TLS
            if isinstance(exc, ssl.SSLError):
                raise handshake_error(self.address, exc) from None
            raise NotSent(f"cannot connect to {self.address}: {exc}") from None
        return conn

    async def _handshake(self, conn: Connection, limit: CallContext) -> Welcome:
        """``Hello``; a ``Challenge`` answered with our ``Proof``; the server's ``Welcome``."""
        hs = ClientHandshake(self.keyring, self.peer_id, "rpc")
        hello = Hello(protocol_version=PROTOCOL_VERSION, role=hs.role, nonce=hs.nonce, peer_id=self.peer_id,
                      host_id=self.host_id)
        reply = (await self._roundtrip(conn, hello, limit, None, None)).message
        if isinstance(reply, Challenge):
            proof = hs.challenged(reply, self.address)
            reply = (await self._roundtrip(conn, Proof(proof=proof), limit, None, None)).message
        elif isinstance(reply, Welcome):
            hs.accepted(self.address)
        if not isinstance(reply, Welcome):
            raise InvalidArgument(f"unexpected handshake reply {type(reply).__name__}")
        return reply

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
            raise reported_error(frame.message, ctx.trace_id)
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
        # A TLS alert (the server refused this process's certificate, or has none of its own) says why.
        lost = handshake_error(self.address, exc) if isinstance(exc, ssl.SSLError) else \
            ConnectionLost(f"connection to {self.address} lost")
        for fut, _ in list(self._pending.values()):
            if not fut.done():
                fut.set_exception(lost)

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
