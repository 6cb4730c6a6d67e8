"""The TCP data server a worker runs beside its control RPC: one selector thread, a bounded pool of senders.

Owns: accepting data-plane connections under caps (``transport.max_connections`` in all,
``transport.max_connections_per_peer`` from one address; more are closed at accept), TLS on them
(``tls.enabled``: a non-blocking handshake stepped in the selector thread, as each socket becomes readable or
writable), the credential handshake (``DataHello`` -> ``Challenge`` -> ``Proof`` -> ``DataReply``, decided by
``wire.handshake``), both under one total deadline (``wire.handshake_timeout`` from accept, whatever the peer
trickles; frames before it are at most ``wire.max_handshake_bytes``), idle connections waiting for their next
request in the one selector thread (no thread per socket; closed after ``transport.idle_timeout``), and
handing each request to a bounded pool of sender threads (``transport.tcp_send``: blocking ``sendall`` from
memoryviews releases the GIL, so several streams move at once). Every request gets an answer or a close, every
refusal a typed error frame before the close, logged at a bounded rate; no exception of a frame, a request or
a bug ends the selector thread (``healthy()``). A send that makes no progress for
``transport.send_progress_timeout`` gives its thread back, and connections that have not authenticated have
their own small budget (``transport.max_unauthenticated``; the oldest is closed first). Does not own: which
bytes a request names (``open_source``), or how a range is sent.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import selectors
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tensorcast.config import TLSConfig, TransportConfig, WireConfig
from tensorcast.credentials import Keyring, allows, check_bind
from tensorcast.errors import InternalError, InvalidArgument, PermissionDenied, TensorCastError, Unauthenticated
from tensorcast.log import RateLimitedLog
from tensorcast.tls import server_context
from tensorcast.transport.base import SourceOpener
from tensorcast.transport.tcp_frames import decode_frame, send_error, send_frame
from tensorcast.transport.tcp_send import RangeSender
from tensorcast.wire.frames import HEADER, parse_header
from tensorcast.wire.handshake import ServerHandshake
from tensorcast.wire.messages import DataHello, DataReply, DataRequest, Proof
from tensorcast.wire.protocol import RESPONSE, required_role
from tensorcast.wire.shared import has_bytes_waiting

__all__ = ["TcpDataServer"]

log = logging.getLogger("tensorcast.transport")
# Largest data-plane control frame after the handshake (a DataRequest with slices is well under this).
_MAX_REQUEST_BYTES = 64 * 1024


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    peer: str
    deadline: float  # monotonic: end of the handshake, then of the idle period
    hs: ServerHandshake
    buf: bytearray = field(default_factory=bytearray)
    authenticated: bool = False
    accepted: float = field(default_factory=time.monotonic)
    tls_pending: bool = False  # TLS is still being negotiated
    heard: bool = False  # a byte has arrived (a silent socket is closed before a peer mid-handshake)


class TcpDataServer:
    """Serves ``DataRequest``s. ``open_source(request)`` returns a ``SourceLease`` over the bytes."""

    def __init__(self, open_source: SourceOpener, config: WireConfig, *, token: str | None,
                 limits: TransportConfig | None = None, corrupt_chunks: int = 0, senders: int = 8,
                 tls: TLSConfig | None = None) -> None:
        self.open_source = open_source
        self.config = config
        self.limits = limits or TransportConfig()
        self.token = token
        self.keyring = Keyring.from_token(token)
        self._tls = server_context(tls) if tls is not None else None
        self._sender = RangeSender(open_source, corrupt_chunks)
        self._lock = threading.Lock()
        self._sel = selectors.DefaultSelector()
        self._sock: socket.socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._back: queue.SimpleQueue[_Conn] = queue.SimpleQueue()  # served connections, waiting again
        self._conns: dict[socket.socket, _Conn] = {}
        self._per_peer: dict[str, int] = {}
        self._senders = ThreadPoolExecutor(senders, thread_name_prefix="tensorcast-data-send")
        self._refusals = RateLimitedLog(log)
        self._bugs = RateLimitedLog(log)  # unexpected exceptions a peer's input reached, with tracebacks
        self._closed = False
        self.beat = time.monotonic()  # the selector thread's last turn: ``healthy()``
        self._thread: threading.Thread | None = None
        self.address = ""

    def start(self, host: str, port: int) -> str:
        check_bind(host, self.token, "the data plane")
        sock = socket.create_server((host, port), backlog=128)
        sock.setblocking(False)
        self._sock = sock
        h, p = sock.getsockname()[:2]
        self.address = f"{h}:{p}"
        self._sel.register(sock, selectors.EVENT_READ, "accept")
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._loop, name="tensorcast-data-io", daemon=True)
        self._thread.start()
        return self.address

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._senders.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            conns = list(self._conns.values())
        for c in conns:
            self._drop(c)
        if self._sock is not None:
            self._sock.close()
        self._wake_r.close()
        self._wake_w.close()

    @property
    def connections(self) -> int:
        return len(self._conns)

    @property
    def bytes_sent(self) -> int:
        return self._sender.bytes_sent

    @property
    def active(self) -> int:
        return self._sender.active

    # ----------------------------------------------------------------- the selector thread
    def healthy(self) -> bool:
        """The selector thread is running and turned within the last few seconds (it turns at least every
        second): what ``/healthz`` and the heartbeat report for the data plane."""
        return self._thread is not None and self._thread.is_alive() and time.monotonic() - self.beat < 5.0

    def _loop(self) -> None:
        while not self._closed:
            self.beat = time.monotonic()
            try:
                self._turn()
            except Exception:  # no frame, peer or bug may end this loop: the data plane would be gone
                self._bugs.exception("data server loop")
                time.sleep(0.01)

    def _turn(self) -> None:
        now = time.monotonic()
        with self._lock:
            deadlines = [c.deadline for c in self._conns.values()]
        wait = min(deadlines, default=now + 1.0) - now
        for key, _ in self._sel.select(max(0.0, min(wait, 1.0))):
            if key.data == "accept":
                self._accept()
            elif key.data == "wake":
                with contextlib.suppress(OSError):
                    self._wake_r.recv(4096)
            else:
                self._readable(key.data)
        while not self._back.empty():
            self._watch(self._back.get())
        self._expire(time.monotonic())

    def _accept(self) -> None:
        assert self._sock is not None
        while True:
            try:
                sock, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # closed
            peer = str(addr[0])
            self._evict_unauthenticated()
            with self._lock:
                full = len(self._conns) >= self.limits.max_connections
                crowded = self._per_peer.get(peer, 0) >= self.limits.max_connections_per_peer
            if full or crowded:
                why = "transport.max_connections" if full else "transport.max_connections_per_peer"
                self._refusals.warning("refused a data-plane connection from %s (%s)", peer, why)
                sock.close()
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._admit(sock, peer)

    def _admit(self, sock: socket.socket, peer: str) -> None:
        sock.setblocking(False)
        if self._tls is not None:  # negotiated in this thread, a step whenever the socket is ready
            sock = self._tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        c = _Conn(sock, peer, time.monotonic() + self.config.handshake_timeout,
                  ServerHandshake(self.keyring, "", "data"), tls_pending=self._tls is not None)
        with self._lock:
            self._conns[sock] = c
            self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
        self._watch(c)

    def _evict_unauthenticated(self) -> None:
        """Connections that have not authenticated yet get a small budget of their own
        (``transport.max_unauthenticated``): at it, the oldest is closed to make room, so that sockets opened
        and left silent (or re-opened as they are closed) cannot lock authenticated peers out."""
        with self._lock:
            waiting = [c for c in self._conns.values() if not c.authenticated]
        if len(waiting) < self.limits.max_unauthenticated:
            return
        # The oldest that never sent a byte goes first: an honest peer sends its hello at once, so a flood of
        # silent sockets re-opened as they are closed cannot push out a peer in the middle of its handshake.
        waiting.sort(key=lambda c: c.accepted)
        oldest = next((c for c in waiting if not c.heard and not has_bytes_waiting(c.sock.fileno())), waiting[0])
        self._refusals.warning("closed the oldest unauthenticated data-plane connection (from %s): %d are "
                               "waiting (transport.max_unauthenticated)", oldest.peer, len(waiting))
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(oldest.sock)
        self._drop(oldest)

    def _watch(self, c: _Conn) -> None:
        """Wait (in this thread) for the connection's next frame."""
        if self._closed:
            self._drop(c)
            return
        c.sock.setblocking(False)
        self._sel.register(c.sock, selectors.EVENT_READ, c)

    def _expire(self, now: float) -> None:
        with self._lock:
            due = [c for c in self._conns.values() if c.deadline <= now]
        for c in due:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(c.sock)
            if not c.authenticated:
                self._refusals.warning("closed a data-plane connection from %s: no handshake within %.1f s",
                                       c.peer, self.config.handshake_timeout)
                if not c.tls_pending:
                    send_error(c.sock, Unauthenticated("no handshake within the timeout"))
            self._drop(c)

    def _drop(self, c: _Conn) -> None:
        with self._lock:
            if self._conns.pop(c.sock, None) is not None:
                left = self._per_peer.get(c.peer, 1) - 1
                if left:
                    self._per_peer[c.peer] = left
                else:
                    self._per_peer.pop(c.peer, None)
        with contextlib.suppress(OSError):
            c.sock.close()

    def _tls_step(self, c: _Conn) -> bool:
        """One step of the TLS handshake (the socket is ready for it); True once TLS is up."""
        sock: Any = c.sock
        try:
            sock.do_handshake()
        except ssl.SSLWantReadError:
            self._sel.modify(sock, selectors.EVENT_READ, c)
            return False
        except ssl.SSLWantWriteError:
            self._sel.modify(sock, selectors.EVENT_WRITE, c)
            return False
        except OSError as exc:  # ssl.SSLError among them: a plain-text peer, a certificate refused
            self._refusals.warning("refused a data-plane connection from %s: TLS handshake failed (%s)", c.peer,
                                   getattr(exc, "reason", None) or type(exc).__name__)
            self._sel.unregister(sock)
            self._drop(c)
            return False
        c.tls_pending = False
        self._sel.modify(sock, selectors.EVENT_READ, c)
        return True

    def _receive(self, c: _Conn) -> bytes | None:
        """What arrived (b"": the peer closed), or None when nothing could be read yet."""
        try:
            data = c.sock.recv(65536)
            while isinstance(c.sock, ssl.SSLSocket) and c.sock.pending():  # decrypted bytes select cannot see
                data += c.sock.recv(65536)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return None
        except OSError:
            return b""
        return data

    def _readable(self, c: _Conn) -> None:
        c.heard = True
        if c.tls_pending and not self._tls_step(c):
            return
        data = self._receive(c)
        if data is None:
            return
        if not data:  # the peer closed: idle connections of a client that went away
            self._sel.unregister(c.sock)
            self._drop(c)
            return
        c.buf += data
        try:
            frame = self._frame(c)
            if frame is not None:
                self._dispatch(c, *frame)
        except TensorCastError as exc:
            self._refusals.warning("refused a data-plane frame from %s: %s", c.peer, exc)
            self._refuse(c, exc)
        except Exception as exc:
            self._bugs.exception("data-plane frame from %s", c.peer)
            self._refuse(c, InternalError(f"data server failed: {type(exc).__name__}"))

    def _refuse(self, c: _Conn, exc: TensorCastError) -> None:
        """Answer with the typed error, then close."""
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(c.sock)
        with contextlib.suppress(OSError):
            c.sock.settimeout(self.config.handshake_timeout)  # a peer that does not read cannot hold this thread
        send_error(c.sock, exc)
        self._drop(c)

    def _frame(self, c: _Conn) -> tuple[Any, Any] | None:
        """The connection's next complete frame (envelope, message), or None until it has arrived."""
        if len(c.buf) < HEADER.size:
            return None
        limit = _MAX_REQUEST_BYTES if c.authenticated else self.config.max_handshake_bytes
        _flags, body_len, payload_len = parse_header(bytes(c.buf[: HEADER.size]), limit)
        if payload_len:
            raise InvalidArgument("data-plane control frames carry no payload")
        if len(c.buf) < HEADER.size + body_len:
            return None
        body = bytes(c.buf[HEADER.size : HEADER.size + body_len])
        del c.buf[: HEADER.size + body_len]
        return decode_frame(body)

    def _dispatch(self, c: _Conn, env: Any, msg: Any) -> None:
        if not c.authenticated:
            self._handshake(c, msg)
            return
        if not isinstance(msg, DataRequest):
            raise InvalidArgument(f"unexpected {type(msg).__name__} on a data connection")
        if not allows(c.hs.role, required_role(msg)):
            raise PermissionDenied(f"a data request needs a {required_role(msg)} credential")
        self._sel.unregister(c.sock)  # a sender thread has it until the range is sent
        c.deadline = float("inf")
        self._senders.submit(self._serve, c, msg, env.trace_id)

    def _handshake(self, c: _Conn, msg: Any) -> None:
        """``DataHello`` (answered with a ``Challenge``, or at once on a cluster without a token), then ``Proof``;
        ``DataReply`` says the connection is authenticated."""
        if isinstance(msg, DataHello):
            challenge = c.hs.hello(msg.role, msg.nonce, msg.peer_id)
            if challenge is not None:
                self._reply(c, challenge)
                return
        elif isinstance(msg, Proof):
            c.hs.answer(msg.proof)
        else:
            raise Unauthenticated("the first data-plane message must be DataHello")
        c.authenticated = True
        c.deadline = time.monotonic() + self.limits.idle_timeout
        self._reply(c, DataReply(total=0, chunk_bytes=0))

    def _reply(self, c: _Conn, msg: Any) -> None:
        """A small frame of the handshake, sent from this thread (bounded by the handshake timeout)."""
        c.sock.setblocking(True)
        c.sock.settimeout(self.config.handshake_timeout)
        send_frame(c.sock, RESPONSE, msg)
        c.sock.setblocking(False)

    # ----------------------------------------------------------------- sender threads
    def _serve(self, c: _Conn, req: DataRequest, trace_id: str) -> None:
        try:
            c.sock.setblocking(True)
            # Every chunk must be taken by the peer within this long: a reader that stops reading (or never
            # starts) gives its sender thread back instead of parking it for good.
            c.sock.settimeout(self.limits.send_progress_timeout)
            self._sender.send(c.sock, req, trace_id)
        except OSError as exc:  # the peer went away, or stopped reading (a timeout)
            log.debug("data connection from %s ended: %s", c.peer, exc)
            self._drop(c)
            return
        except Exception:  # a bug, maybe mid-range: the stream cannot continue
            self._bugs.exception("sending a range to %s", c.peer)
            self._drop(c)
            return
        c.deadline = time.monotonic() + self.limits.idle_timeout
        self._back.put(c)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
