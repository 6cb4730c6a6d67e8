"""The TCP data server a worker runs beside its control RPC: one selector thread, a bounded pool of senders.

Owns: accepting data-plane connections under caps (``transport.max_connections`` in all,
``transport.max_connections_per_peer`` from one address; more are closed at accept), the handshake under
one total deadline (``wire.handshake_timeout`` from accept, whatever the peer trickles; frames before it
are at most ``wire.max_handshake_bytes``), idle connections waiting for their next request in the one
selector thread (no thread per socket; closed after ``transport.idle_timeout``), and sending requested
ranges on a bounded pool of threads (blocking ``sendall`` from memoryviews releases the GIL: several
streams move at once). Each chunk is preceded by its xxh3-64 checksum (cached per blob where
possible; else computed as the chunk is sent and handed back to the source, ``SourceLease.learn``).
Every refusal is a typed error frame before the close, logged at a bounded rate. Does not own: which
bytes a request names (``open_source``).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import xxhash

from tensorcast.checksums import CHUNK_BYTES
from tensorcast.config import TransportConfig, WireConfig
from tensorcast.errors import InvalidArgument, TensorCastError, Unauthenticated
from tensorcast.log import RateLimitedLog
from tensorcast.transport.base import SourceOpener
from tensorcast.transport.tcp_frames import CHECKSUM, decode_frame, send_error, send_frame
from tensorcast.wire.frames import HEADER, parse_header
from tensorcast.wire.messages import DataHello, DataReply, DataRequest
from tensorcast.wire.protocol import RESPONSE
from tensorcast.wire.rpc import token_refusal

__all__ = ["TcpDataServer"]

log = logging.getLogger("tensorcast.transport")
# Largest data-plane control frame after the handshake (a DataRequest with slices is well under this).
_MAX_REQUEST_BYTES = 64 * 1024


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    peer: str
    deadline: float  # monotonic: end of the handshake, then of the idle period
    buf: bytearray = field(default_factory=bytearray)
    authenticated: bool = False


class TcpDataServer:
    """Serves ``DataRequest``s. ``open_source(request)`` returns a ``SourceLease`` over the bytes."""

    def __init__(self, open_source: SourceOpener, config: WireConfig, *, token: str | None,
                 limits: TransportConfig | None = None, corrupt_chunks: int = 0, senders: int = 8) -> None:
        self.open_source = open_source
        self.config = config
        self.limits = limits or TransportConfig()
        self.token = token
        # Fault injection for tests: flip one byte in each of the next N chunks sent.
        self._corrupt_left = corrupt_chunks
        self._lock = threading.Lock()
        self._sel = selectors.DefaultSelector()
        self._sock: socket.socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._back: queue.SimpleQueue[_Conn] = queue.SimpleQueue()  # served connections, waiting again
        self._conns: dict[socket.socket, _Conn] = {}
        self._per_peer: dict[str, int] = {}
        self._senders = ThreadPoolExecutor(senders, thread_name_prefix="tensorcast-data-send")
        self._refusals = RateLimitedLog(log)
        self._closed = False
        self._thread: threading.Thread | None = None
        self.address = ""
        self.bytes_sent = 0
        self.active = 0

    def start(self, host: str, port: int) -> str:
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

    # ----------------------------------------------------------------- the selector thread
    def _loop(self) -> None:
        while not self._closed:
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
            with self._lock:
                full = len(self._conns) >= self.limits.max_connections
                crowded = self._per_peer.get(peer, 0) >= self.limits.max_connections_per_peer
                if not (full or crowded):
                    c = _Conn(sock, peer, time.monotonic() + self.config.handshake_timeout)
                    self._conns[sock] = c
                    self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
            if full or crowded:
                why = "transport.max_connections" if full else "transport.max_connections_per_peer"
                self._refusals.warning("refused a data-plane connection from %s (%s)", peer, why)
                sock.close()
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._watch(c)

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

    def _readable(self, c: _Conn) -> None:
        try:
            data = c.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
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
            self._sel.unregister(c.sock)
            c.sock.setblocking(True)
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
            if not isinstance(msg, DataHello):
                raise Unauthenticated("the first data-plane message must be DataHello")
            refusal = token_refusal(self.token, msg.token)
            if refusal:
                raise Unauthenticated(refusal)
            c.authenticated = True
            c.deadline = time.monotonic() + self.limits.idle_timeout
            c.sock.setblocking(True)
            c.sock.settimeout(self.config.handshake_timeout)
            send_frame(c.sock, RESPONSE, DataReply(total=0, chunk_bytes=0))
            c.sock.setblocking(False)
            return
        if not isinstance(msg, DataRequest):
            raise InvalidArgument(f"unexpected {type(msg).__name__} on a data connection")
        self._sel.unregister(c.sock)  # a sender thread has it until the range is sent
        c.deadline = float("inf")
        self._senders.submit(self._serve, c, msg, env.trace_id)

    # ----------------------------------------------------------------- sender threads
    def _serve(self, c: _Conn, req: DataRequest, trace_id: str) -> None:
        try:
            c.sock.setblocking(True)
            c.sock.settimeout(None)
            self._send_range(c.sock, req, trace_id)
        except OSError as exc:
            log.debug("data connection from %s ended: %s", c.peer, exc)
            self._drop(c)
            return
        c.deadline = time.monotonic() + self.limits.idle_timeout
        self._back.put(c)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _send_range(self, conn: socket.socket, req: DataRequest, trace_id: str) -> None:
        try:
            lease = self.open_source(req)
        except TensorCastError as exc:
            send_error(conn, exc)
            return
        with self._lock:
            self.active += 1
        try:
            whole = lease.view
            length = len(whole) - req.offset if req.length < 0 else req.length
            if req.offset < 0 or length < 0 or req.offset + length > len(whole):
                send_error(conn, InvalidArgument(f"range [{req.offset}, {req.offset + length}) outside "
                                                 f"{len(whole)} bytes"))
                return
            chunk = CHUNK_BYTES
            on_grid = req.offset % chunk == 0 and not req.slices
            cached = lease.checksums if on_grid else None
            learned: list[int] | None = [] if on_grid and lease.learn is not None else None
            send_frame(conn, RESPONSE, DataReply(total=length, chunk_bytes=chunk, tier=lease.tier), trace_id)
            view = whole[req.offset : req.offset + length]
            for start in range(0, length, chunk):
                piece = view[start : start + chunk]
                at = req.offset + start
                # A cached checksum covers a whole grid chunk; a range ending mid-chunk needs its own.
                whole_chunk = len(piece) == min(chunk, len(whole) - at)
                check = cached[at // chunk] if cached and whole_chunk else xxhash.xxh3_64_intdigest(piece)
                if learned is not None and whole_chunk:
                    learned.append(check)
                piece = self._maybe_corrupt(piece)
                conn.sendall(CHECKSUM.pack(check))
                conn.sendall(piece)
                self.bytes_sent += len(piece)
            if learned and lease.learn is not None:
                lease.learn(req.offset // chunk, learned)
            if lease.sent is not None:
                lease.sent(length)
        finally:
            with self._lock:
                self.active -= 1
            lease.release()

    def _maybe_corrupt(self, piece: memoryview) -> memoryview:
        with self._lock:
            if self._corrupt_left <= 0:
                return piece
            self._corrupt_left -= 1
        bad = bytearray(piece)
        bad[len(bad) // 2] ^= 0xFF
        return memoryview(bad)
