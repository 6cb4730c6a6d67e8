"""Request/response RPC on the calling thread: one blocking connection to one server, for replies without payload.

Owns: ``BlockingChannel``, the synchronous twin of ``wire.channel.RpcChannel`` for a thread that would otherwise
hand each call to an event loop on another thread and wait for it to come back (two thread wake-ups, each as
dear as the round trip itself on a busy host): opening the connection (TCP, TLS when ``tls.enabled``), the
caller's handshake (``wire.handshake``, the same proofs; any error frame in it ends it), one call at a time,
each bounded by its context's deadline, the reply checked against the type the request declares, and typed
errors as the server reported them. A call that could not be sent raises ``NotSent`` and one whose connection
broke (closed, reset, or given up on by the kernel's dead-peer detection) ``ConnectionLost``, as
``RpcChannel`` does, so a caller can go the event loop's way instead (with its fail-over); connecting and the
handshake take at most half of what is left of the call's time, so that way keeps the other half. Frames are
parsed by the same sans-IO ``wire.frame_reader`` with the same limits, charged to the receive budget it is
given (the process's); a reply carrying a payload is refused (the calls made here have none). One thread
calls; another may ``abort`` it. Does not own: which calls go this way, or which thread holds which channel
(``client.thread_calls``).
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import ssl
import threading
import time
from typing import Any, TypeVar, cast

from tensorcast.config import TLSConfig, WireConfig
from tensorcast.context import CallContext
from tensorcast.credentials import Keyring
from tensorcast.errors import (
    DeadlineExceeded,
    InternalError,
    InvalidArgument,
    TensorCastError,
    Unavailable,
)
from tensorcast.obs import metrics, tracing
from tensorcast.tls import client_context, handshake_error, server_hostname
from tensorcast.wire.codec import decode_envelope, decode_message
from tensorcast.wire.frame_parts import ConnectionLost, NotSent, checked_reply, encode_envelope, reported_error
from tensorcast.wire.frame_reader import Body, FrameReader
from tensorcast.wire.frames import pack_header
from tensorcast.wire.handshake import ClientHandshake
from tensorcast.wire.messages import PROTOCOL_VERSION, Challenge, Hello, Proof, Request, Welcome
from tensorcast.wire.protocol import ERROR, REQUEST
from tensorcast.wire.rpc import parse_address
from tensorcast.wire.shared import BudgetFull, ReceiveBudget
from tensorcast.wire.sockets import detect_dead_peer

__all__ = ["BlockingChannel"]

R = TypeVar("R")

_STAGING = 64 * 1024  # replies of a lookup are a few KiB; larger bodies are read into a buffer of their own


class BlockingChannel:
    def __init__(self, address: str, config: WireConfig, *, token: str | None, peer_id: str = "",
                 host_id: str = "", tls: TLSConfig | None = None, budget: ReceiveBudget | None = None) -> None:
        self.address = address
        self.config = config
        self.keyring = Keyring.from_token(token)
        self.peer_id, self.host_id = peer_id, host_id
        self.tls = tls
        self.welcome: Welcome | None = None
        self._sock: socket.socket | None = None
        self._reader: FrameReader | None = None
        self._ids = itertools.count(1)
        self._budget = budget if budget is not None else ReceiveBudget(config.receive_budget_bytes)
        self._busy = threading.Lock()  # held by the calling thread for a call: ``abort`` sees whether one runs
        self._aborted = False

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def call(self, msg: Request[R], ctx: CallContext) -> R:
        """Send ``msg`` and return its reply, of the type the request declares; the typed error the server
        reported, ``DeadlineExceeded`` past ``ctx``'s deadline, ``NotSent`` / ``ConnectionLost`` when the server
        could not be reached (the connection is closed then, and opened again by the next call)."""
        method = type(msg).__name__
        ctx.check(method)
        started = time.perf_counter()
        outcome = "ok"
        try:
            with self._busy, tracing.span(method, ctx.trace_id, kind="client", attributes={"peer": self.address}):
                try:
                    if not self._aborted:
                        if self._sock is None:
                            self._connect(ctx)
                        reply, kind = self._roundtrip(msg, ctx)
                    if self._aborted:  # before the call, or while it ran: no reply after the client closed
                        raise NotSent(f"the connection to {self.address} was closed with its client")
                except _Unsent as exc:
                    raise NotSent(f"cannot send to {self.address}: {exc.args[0]}") from None
                finally:
                    if self._aborted:
                        self.close()
                if kind == ERROR:
                    raise reported_error(reply, ctx.trace_id)
                return cast(R, checked_reply(msg, reply, self.address, ctx.trace_id))
        except TensorCastError as exc:
            outcome = exc.code
            raise
        finally:
            # ``abort`` raises the flag, then tries the lock: if it found the lock held by this call, this
            # side closes what it opened.
            if self._aborted and self._busy.acquire(blocking=False):
                try:
                    self.close()
                finally:
                    self._busy.release()
            roles = self.welcome.roles if self.welcome is not None else ()
            metrics.rpc_sent(method, "gs" if "gs" in roles else "worker", outcome, time.perf_counter() - started)

    def close(self) -> None:
        """Close the connection (the calling thread's, or one no call uses), giving back what its reader held."""
        sock, reader, self._sock, self._reader, self.welcome = self._sock, self._reader, None, None, None
        if reader is not None:
            reader.close()
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    def abort(self) -> None:
        """From another thread: no call opens the connection again; an idle one is closed, and one in use is
        shut down (its call fails at once and its thread closes it; the descriptor stays its until then)."""
        self._aborted = True
        if self._busy.acquire(blocking=False):
            try:
                self.close()
            finally:
                self._busy.release()
            return
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the descriptor's, under any TLS layer

    # ------------------------------------------------------------------ connecting

    def _connect(self, ctx: CallContext) -> None:
        """Open the connection and handshake, within the handshake timeout and half of ``ctx``'s time left
        (a server that cannot be reached this way leaves the rest to the event loop's fail-over); ``NotSent``
        when that fails for any reason but a refused credential or certificate."""
        now = time.time()
        deadline = now + self.config.handshake_timeout
        if ctx.deadline is not None:
            deadline = min(deadline, now + max((ctx.deadline - now) / 2, 0.001))
        limit = CallContext(deadline=deadline, trace_id=ctx.trace_id)
        host, port = parse_address(self.address)
        left = min(self.config.connect_timeout, max(limit.remaining() or 0.0, 0.001))
        try:
            raw = socket.create_connection((host, port), timeout=left)
        except OSError as exc:  # refused, unreachable, timed out
            raise NotSent(f"cannot connect to {self.address}: {exc}") from None
        try:
            sock = self._secured(raw, host)
        except BaseException:
            raw.close()
            raise
        self._sock = sock
        # Until the handshake is done: small frames only, as the server holds us to.
        self._reader = FrameReader(4096, self.config.max_handshake_bytes, self._budget, payloads=False)
        try:
            self.welcome = self._handshake(limit)
        except (_Unsent, ConnectionLost, DeadlineExceeded) as exc:
            self.close()
            raise NotSent(f"no handshake with {self.address}: {exc}") from None
        except BaseException:
            self.close()
            raise
        self._reader.max_body = self.config.max_frame_bytes
        self._reader.grow(_STAGING)

    def _secured(self, raw: socket.socket, host: str) -> socket.socket:
        """``raw`` with its options set, and TLS over it when configured."""
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.config.dead_peer_timeout > 0:
            detect_dead_peer(raw, self.config.dead_peer_timeout)
        tls = client_context(self.tls) if self.tls is not None else None
        if tls is None or self.tls is None:
            return raw
        try:
            return tls.wrap_socket(raw, server_hostname=server_hostname(self.tls, host))
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError) as exc:  # the server cut it
            raise NotSent(f"TLS handshake with {self.address} cut short: {exc}") from None
        except ssl.SSLError as exc:  # a certificate that does not verify, a peer without TLS
            raise handshake_error(self.address, exc) from None
        except OSError as exc:  # timed out, reset: as unreachable as a refused connection
            raise NotSent(f"TLS handshake with {self.address} failed: {exc}") from None

    def _handshake(self, limit: CallContext) -> Welcome:
        hs = ClientHandshake(self.keyring, self.peer_id, "rpc")
        hello = Hello(protocol_version=PROTOCOL_VERSION, role=hs.role, nonce=hs.nonce, peer_id=self.peer_id,
                      host_id=self.host_id)
        reply = self._handshake_step(hello, limit)
        if isinstance(reply, Challenge):
            reply = self._handshake_step(Proof(proof=hs.challenged(reply, self.address)), limit)
        elif isinstance(reply, Welcome):
            hs.accepted(self.address)  # only right when neither side has a token
        if not isinstance(reply, Welcome):
            raise InvalidArgument(f"unexpected handshake reply {type(reply).__name__}")
        return reply

    def _handshake_step(self, msg: Any, limit: CallContext) -> Any:
        """One handshake exchange; any error frame ends the handshake (whatever its body claims to be)."""
        reply, kind = self._roundtrip(msg, limit)
        if kind == ERROR:
            raise reported_error(reply, limit.trace_id)
        return reply

    # ------------------------------------------------------------------ one exchange

    def _roundtrip(self, msg: Any, ctx: CallContext) -> tuple[Any, int]:
        """Write ``msg``'s frame and read frames until its reply (message, envelope kind). Raises ``_Unsent``
        if nothing left this side; once it did, a broken connection is ``ConnectionLost``."""
        sock, reader = self._sock, self._reader
        assert sock is not None and reader is not None
        request_id = next(self._ids)
        method = type(msg).__name__
        body = encode_envelope(request_id, REQUEST, ctx.trace_id, ctx.deadline, msg, tracing.current_span_id())
        try:
            self._timeout(sock, ctx, method)
            sock.sendall(pack_header(len(body), 0) + body)
        except OSError as exc:  # (TimeoutError included)
            self.close()
            if _out_of_time(exc):
                raise self._late(method, ctx) from None
            raise _Unsent(str(exc)) from None
        except BaseException:
            self.close()
            raise
        try:
            while True:
                event = reader.next_event()
                if event is None:
                    self._timeout(sock, ctx, method)
                    n = sock.recv_into(reader.get_buffer())
                    if n == 0:
                        raise ConnectionLost(f"{self.address} closed the connection")
                    reader.buffer_updated(n)
                    continue
                assert isinstance(event, Body)  # payloads are refused by the reader (Unauthenticated)
                env = decode_envelope(event.body)
                if env.request_id == request_id or (env.request_id == 0 and env.kind == ERROR):
                    if env.request_id == 0:
                        self.close()  # the server failed the connection: it is closing it
                    return decode_message(env.body), env.kind
        except OSError as exc:  # closed, reset, TLS torn down, the kernel gave up on the peer; or out of time
            self.close()
            if _out_of_time(exc):
                raise self._late(method, ctx) from None
            raise ConnectionLost(f"connection to {self.address} lost: {exc}") from None
        except TensorCastError as exc:  # a frame this side cannot take (too large, malformed, a payload)
            self.close()
            if isinstance(exc, Unavailable | DeadlineExceeded):  # lost, or out of time between two reads
                raise
            if isinstance(exc, BudgetFull):  # the process's receive buffers are full: the loop's way
                raise ConnectionLost(f"reply from {self.address} not taken: {exc.message}") from None
            raise InternalError(f"{self.address} answered {method} with a frame this channel cannot take: "
                                f"{exc.message}", trace_id=ctx.trace_id) from None
        except BaseException:
            self.close()
            raise

    def _timeout(self, sock: socket.socket, ctx: CallContext, method: str) -> None:
        left = ctx.remaining()
        if left is not None and left <= 0:
            raise self._late(method, ctx)
        sock.settimeout(left)

    def _late(self, method: str, ctx: CallContext) -> DeadlineExceeded:
        return DeadlineExceeded(f"{method} to {self.address}: deadline exceeded", trace_id=ctx.trace_id)


def _out_of_time(exc: OSError) -> bool:
    """The socket's own timeout (the call's deadline), not the kernel giving up on a dead peer (ETIMEDOUT from
    keepalive or TCP_USER_TIMEOUT, which is a lost connection)."""
    return isinstance(exc, TimeoutError) and exc.errno is None


class _Unsent(Exception):
    """The request's bytes did not leave (the connection was found closed when writing)."""
