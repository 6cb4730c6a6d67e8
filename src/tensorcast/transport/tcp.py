"""Bulk tensor transfer over TCP, the client side: a range split over several parallel streams, each
``recv_into`` its part of the destination, every chunk checked.

Owns: ``TcpTransport`` — pooled, authenticated connections per data server (TLS when ``tls.enabled``; the
handshake of ``wire.handshake``: ``DataHello``, a ``Proof`` answering the server's ``Challenge``; a pooled
connection the server closed meanwhile is replaced once, transparently), the stream split, and checking each chunk
against the xxh3-64 checksum sent before it: a mismatch discards the range and raises ``ChunkCorrupted``
(the caller retries, here or from another replica), so corrupt bytes are never kept. A fetch ends by its
deadline however slowly the bytes arrive (``DeadlineExceeded``; ``Unavailable`` when it passes while
connecting). Blocking
``recv_into`` releases the GIL, which is what lets several streams move bytes at once. The server side is
``transport.tcp_server``. Does not own: which bytes a request names.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec
import xxhash

from tensorcast.checksums import CHUNK_BYTES, ChunkCorrupted
from tensorcast.config import TLSConfig, TransportConfig, WireConfig
from tensorcast.credentials import Keyring
from tensorcast.errors import DeadlineExceeded, Unavailable, error_from_code
from tensorcast.tls import client_context, handshake_error, server_hostname
from tensorcast.transport.base import FetchStats, SourceOpener, split_ranges
from tensorcast.transport.tcp_frames import CHECKSUM, PeerClosed, recv_exact, recv_frame, send_frame
from tensorcast.transport.tcp_server import TcpDataServer
from tensorcast.wire.handshake import ClientHandshake
from tensorcast.wire.messages import PROTOCOL_VERSION, Challenge, DataHello, DataReply, DataRequest, Proof
from tensorcast.wire.protocol import ERROR, REQUEST
from tensorcast.wire.rpc import parse_address

__all__ = ["TcpTransport"]

# Connections opened for one fetch when the server closes them before authenticating us.
_HANDSHAKE_TRIES = 3


@dataclass
class _Pool:
    idle: dict[str, list[socket.socket]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class TcpTransport:
    """Client side: fetch a byte range of a remote tensor into ``dest`` over ``streams`` connections."""

    kind = "tcp"

    def __init__(self, config: WireConfig, *, token: str | None, max_streams: int = 8,
                 limits: TransportConfig | None = None, tls: TLSConfig | None = None) -> None:
        self.config = config
        self.token = token
        self.keyring = Keyring.from_token(token)
        self.tls = tls
        self.limits = limits or TransportConfig()
        self._max_streams = max_streams
        self._pool = _Pool()
        self._executor = ThreadPoolExecutor(max_workers=max_streams, thread_name_prefix="tensorcast-fetch")

    def serve(self, open_source: SourceOpener, *, corrupt_chunks: int = 0) -> TcpDataServer:
        return TcpDataServer(open_source, self.config, token=self.token, limits=self.limits,
                             corrupt_chunks=corrupt_chunks, senders=self._max_streams, tls=self.tls)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        with self._pool.lock:
            for conns in self._pool.idle.values():
                for c in conns:
                    c.close()
            self._pool.idle.clear()

    def _pooled(self, address: str) -> socket.socket | None:
        with self._pool.lock:
            conns = self._pool.idle.get(address)
            return conns.pop() if conns else None

    def _connect(self, address: str, deadline: float | None) -> socket.socket:
        """A new authenticated connection. One the server closes before authenticating us is opened again
        (``_HANDSHAKE_TRIES`` in all, within the deadline): under a flood of silent sockets the server closes the
        oldest unauthenticated connections to make room (``transport.max_unauthenticated``), and an honest one
        whose hello had not left yet can be among them."""
        for attempt in range(1, _HANDSHAKE_TRIES + 1):
            try:
                return self._connect_once(address, deadline)
            except _HandshakeCut:
                if attempt == _HANDSHAKE_TRIES or (deadline is not None and time.time() >= deadline):
                    raise
        raise AssertionError("unreachable")

    def _connect_once(self, address: str, deadline: float | None) -> socket.socket:
        host, port = parse_address(address)
        timeout = self.config.connect_timeout if deadline is None else max(0.001, deadline - time.time())
        try:
            sock = socket.create_connection((host, port), timeout=min(timeout, self.config.connect_timeout))
        except OSError as exc:
            raise Unavailable(f"cannot connect to data plane at {address}: {exc}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        until = time.time() + self.config.connect_timeout  # the handshake: as long again, within the deadline
        if deadline is not None:
            until = min(until, deadline)
        try:
            sock = self._secure(sock, address, host, until)
            self._handshake(sock, address, until)
        except TimeoutError as exc:
            sock.close()
            raise Unavailable(f"data plane at {address}: handshake failed: {exc}") from None
        except (OSError, PeerClosed) as exc:
            sock.close()
            raise _HandshakeCut(f"data plane at {address}: handshake failed: {exc}") from None
        except BaseException:
            sock.close()
            raise
        return sock

    def _secure(self, sock: socket.socket, address: str, host: str, until: float) -> socket.socket:
        """TLS over ``sock`` when configured (the server's certificate checked), by ``until``."""
        ctx = client_context(self.tls) if self.tls is not None else None
        if ctx is None or self.tls is None:
            return sock
        sock.settimeout(max(0.001, until - time.time()))
        try:
            return ctx.wrap_socket(sock, server_hostname=server_hostname(self.tls, host))
        except ssl.SSLError as exc:
            raise handshake_error(f"the data plane at {address}", exc) from None

    def _handshake(self, sock: socket.socket, address: str, until: float) -> None:
        """``DataHello``; a ``Challenge`` answered with our ``Proof``; the server's ``DataReply``."""
        hs = ClientHandshake(self.keyring, "", "data")
        send_frame(sock, REQUEST, DataHello(protocol_version=PROTOCOL_VERSION, role=hs.role, nonce=hs.nonce))
        env, reply = recv_frame(sock, self.config.max_frame_bytes, until)
        if env.kind != ERROR and isinstance(reply, Challenge):
            send_frame(sock, REQUEST, Proof(proof=hs.challenged(reply, f"the data plane at {address}")))
            env, reply = recv_frame(sock, self.config.max_frame_bytes, until)
        elif env.kind != ERROR and isinstance(reply, DataReply):
            hs.accepted(f"the data plane at {address}")
        if env.kind == ERROR:
            raise error_from_code(reply.code, reply.message)
        if not isinstance(reply, DataReply):
            raise Unavailable(f"data plane at {address}: unexpected handshake reply {type(reply).__name__}")

    def _release(self, address: str, sock: socket.socket) -> None:
        with self._pool.lock:
            self._pool.idle.setdefault(address, []).append(sock)

    def fetch(
        self,
        address: str,
        request: DataRequest,
        dest: memoryview,
        *,
        streams: int = 1,
        deadline: float | None = None,
        trace_id: str = "",
        checksums: list[int] | None = None,
    ) -> FetchStats:
        """Fill ``dest`` with the requested bytes (``request.offset`` + ``len(dest)``). Blocking.

        If ``checksums`` is a list, it receives the verified chunk checksums (grid ``CHUNK_BYTES`` from
        ``request.offset``), so the receiver can serve the bytes later without hashing them again."""
        t0 = time.perf_counter()
        total = len(dest)
        ranges = split_ranges(total, streams, bool(request.slices))
        stats = FetchStats(streams=len(ranges))

        sums: list[int] = [0] * (-(-total // CHUNK_BYTES))

        def one(lo: int, hi: int) -> str:
            req = msgspec.structs.replace(request, offset=request.offset + lo, length=hi - lo)
            return self._fetch_range(address, req, dest[lo:hi], deadline, trace_id, sums, lo // CHUNK_BYTES)

        if len(ranges) == 1:
            stats.tier = one(*ranges[0])
        else:
            futures = [self._executor.submit(one, lo, hi) for lo, hi in ranges]
            errors: list[BaseException] = []
            for f in futures:
                try:
                    stats.tier = f.result()
                except BaseException as exc:
                    errors.append(exc)
            if errors:
                raise errors[0]
        if checksums is not None:
            checksums[:] = sums
        stats.bytes = total
        stats.seconds = time.perf_counter() - t0
        return stats

    def _fetch_range(self, address: str, req: DataRequest, dest: memoryview, deadline: float | None,
                     trace_id: str, sums: list[int], first_chunk: int) -> str:
        sock = self._pooled(address)
        if sock is not None:
            try:
                return self._fetch_on(sock, address, req, dest, deadline, trace_id, sums, first_chunk)
            except _StaleConnection:
                pass  # the server closed the idle connection (idle timeout, restart): one fresh try
        sock = self._connect(address, deadline)
        try:
            return self._fetch_on(sock, address, req, dest, deadline, trace_id, sums, first_chunk)
        except _StaleConnection as exc:
            raise Unavailable(f"data plane at {address} closed the connection: {exc}") from None

    def _fetch_on(self, sock: socket.socket, address: str, req: DataRequest, dest: memoryview,
                  deadline: float | None, trace_id: str, sums: list[int], first_chunk: int) -> str:
        ok = False
        started = False  # the server answered: a failure from here on is not a stale connection
        try:
            left = None if deadline is None else deadline - time.time()
            if left is not None and left <= 0:
                raise DeadlineExceeded("data transfer: deadline passed")
            sock.settimeout(left)
            send_frame(sock, REQUEST, req, trace_id, deadline)
            env, reply = recv_frame(sock, self.config.max_frame_bytes, deadline)
            started = True
            if env.kind == ERROR:
                raise error_from_code(reply.code, reply.message, trace_id)
            if not isinstance(reply, DataReply) or reply.total != len(dest):
                raise Unavailable(f"data plane at {address} answered {reply!r} for {len(dest)} bytes")
            check = bytearray(8)
            for i, start in enumerate(range(0, reply.total, reply.chunk_bytes)):
                piece = dest[start : start + reply.chunk_bytes]
                recv_exact(sock, memoryview(check), deadline)
                recv_exact(sock, piece, deadline)
                got = xxhash.xxh3_64_intdigest(piece)
                sums[first_chunk + i] = got
                if got != CHECKSUM.unpack(check)[0]:
                    raise ChunkCorrupted(f"chunk at byte {req.offset + start} of {req.name!r} from {address} "
                                         "failed its checksum")
            ok = True
            return reply.tier
        except TimeoutError:
            raise DeadlineExceeded(f"data transfer from {address}: deadline exceeded", trace_id=trace_id) from None
        except (OSError, Unavailable) as exc:
            if not started and not isinstance(exc, ChunkCorrupted):
                raise _StaleConnection(str(exc)) from None
            if isinstance(exc, Unavailable):
                raise
            raise Unavailable(f"data transfer from {address} failed: {exc}") from None
        finally:
            if ok:
                sock.settimeout(None)
                self._release(address, sock)
            else:
                sock.close()


class _HandshakeCut(Unavailable):
    """The server closed a new connection before it authenticated us (tried again: ``TcpTransport._connect``)."""


class _StaleConnection(Exception):
    """A request on a connection failed before the server answered it (closed meanwhile)."""
