"""Bulk tensor transfer over TCP: several parallel streams, ``recv_into`` the destination, checked chunks.

Owns: the data-plane server a worker runs beside its control RPC (a listener thread, one thread per
connection: blocking ``sendall`` from memoryviews and ``recv_into`` destination buffers release the GIL,
which is what lets several streams move bytes at once), and the client that splits a range over N
streams. Every chunk is preceded by its xxh3-64 checksum; a receiver that sees a mismatch discards the
range and raises ``ChunkCorrupted`` (the caller retries, here or from another replica), so corrupt bytes
are never kept. Connections authenticate with the cluster token like control connections do.
Does not own: which bytes a request names (the ``open_source`` callback resolves that).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import xxhash

from tensorcast.checksums import CHUNK_BYTES, ChunkCorrupted
from tensorcast.config import WireConfig
from tensorcast.errors import (
    DeadlineExceeded,
    InvalidArgument,
    TensorCastError,
    Unauthenticated,
    Unavailable,
    error_from_code,
)
from tensorcast.transport.base import FetchStats, SourceOpener, split_ranges
from tensorcast.wire.connection import encode_envelope
from tensorcast.wire.frames import HEADER, pack_header, parse_header
from tensorcast.wire.messages import PROTOCOL_VERSION, DataHello, DataReply, DataRequest, ErrorReply
from tensorcast.wire.protocol import ERROR, REQUEST, RESPONSE, Envelope, Message
from tensorcast.wire.rpc import parse_address

__all__ = ["TcpDataServer", "TcpTransport"]

log = logging.getLogger("tensorcast.transport")
_CHECK = struct.Struct(">Q")
_ENV = msgspec.msgpack.Decoder(Envelope)
_MSG = msgspec.msgpack.Decoder(Message)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    pos, n = 0, len(view)
    while pos < n:
        got = sock.recv_into(view[pos:])
        if got == 0:
            raise Unavailable("data connection closed by peer mid-transfer")
        pos += got


def _recv_frame(sock: socket.socket, max_body: int) -> tuple[Envelope, Any]:
    hdr = bytearray(HEADER.size)
    _recv_exact(sock, memoryview(hdr))
    _flags, body_len, payload_len = parse_header(bytes(hdr), max_body)
    if payload_len:
        raise InvalidArgument("data-plane control frames carry no payload")
    body = bytearray(body_len)
    _recv_exact(sock, memoryview(body))
    env = _ENV.decode(body)
    return env, _MSG.decode(env.body)


def _send_frame(sock: socket.socket, kind: int, message: Any, trace_id: str = "") -> None:
    body = encode_envelope(0, kind, trace_id, None, message)
    sock.sendall(pack_header(len(body), 0) + body)


def _send_error(sock: socket.socket, exc: TensorCastError) -> None:
    with contextlib.suppress(OSError):
        _send_frame(sock, ERROR, ErrorReply(code=exc.code, message=exc.message, retryable=exc.retryable))


class TcpDataServer:
    """Serves ``DataRequest``s. ``open_source(request)`` returns a ``SourceLease`` over the bytes."""

    def __init__(
        self,
        open_source: SourceOpener,
        config: WireConfig,
        *,
        token: str | None,
        corrupt_chunks: int = 0,
    ) -> None:
        self.open_source = open_source
        self.config = config
        self.token = token
        # Fault injection for tests: flip one byte in each of the next N chunks sent.
        self._corrupt_left = corrupt_chunks
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._closed = False
        self.address = ""
        self.bytes_sent = 0
        self.active = 0

    def start(self, host: str, port: int) -> str:
        sock = socket.create_server((host, port), backlog=128, reuse_port=False)
        self._sock = sock
        h, p = sock.getsockname()[:2]
        self.address = f"{h}:{p}"
        threading.Thread(target=self._accept_loop, name="tensorcast-data-accept", daemon=True).start()
        return self.address

    def close(self) -> None:
        self._closed = True
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        with self._lock:
            for c in list(self._conns):
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
                c.close()

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="tensorcast-data", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(self.config.handshake_timeout)
            _, hello = _recv_frame(conn, self.config.max_frame_bytes)
            if not isinstance(hello, DataHello):
                raise Unauthenticated("the first data-plane message must be DataHello")
            if self.token is not None and not hmac.compare_digest((hello.token or "").encode(), self.token.encode()):
                raise Unauthenticated("wrong or missing cluster token")
            _send_frame(conn, RESPONSE, DataReply(total=0, chunk_bytes=0))
            conn.settimeout(None)
            while not self._closed:
                try:
                    env, req = _recv_frame(conn, self.config.max_frame_bytes)
                except Unavailable:
                    return  # client closed an idle connection
                if not isinstance(req, DataRequest):
                    raise InvalidArgument(f"unexpected {type(req).__name__} on a data connection")
                self._send_range(conn, req, env.trace_id)
        except TensorCastError as exc:
            _send_error(conn, exc)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.debug("data connection ended: %s", exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _send_range(self, conn: socket.socket, req: DataRequest, trace_id: str) -> None:
        try:
            lease = self.open_source(req)
        except TensorCastError as exc:
            _send_error(conn, exc)
            return
        with self._lock:
            self.active += 1
        try:
            whole = lease.view
            length = len(whole) - req.offset if req.length < 0 else req.length
            if req.offset < 0 or length < 0 or req.offset + length > len(whole):
                _send_error(conn, InvalidArgument(f"range [{req.offset}, {req.offset + length}) outside "
                                                  f"{len(whole)} bytes"))
                return
            chunk = CHUNK_BYTES
            cached = lease.checksums if req.offset % chunk == 0 and not req.slices else None
            _send_frame(conn, RESPONSE, DataReply(total=length, chunk_bytes=chunk, tier=lease.tier), trace_id)
            view = whole[req.offset : req.offset + length]
            for start in range(0, length, chunk):
                piece = view[start : start + chunk]
                at = req.offset + start
                # A cached checksum covers a whole grid chunk; a range ending mid-chunk needs its own.
                whole_chunk = len(piece) == min(chunk, len(whole) - at)
                check = cached[at // chunk] if cached and whole_chunk else xxhash.xxh3_64_intdigest(piece)
                if self._corrupt_left > 0:
                    with self._lock:
                        self._corrupt_left -= 1
                    bad = bytearray(piece)
                    bad[len(bad) // 2] ^= 0xFF
                    piece = memoryview(bad)
                conn.sendall(_CHECK.pack(check))
                conn.sendall(piece)
                self.bytes_sent += len(piece)
        finally:
            with self._lock:
                self.active -= 1
            lease.release()


@dataclass
class _Pool:
    idle: dict[str, list[socket.socket]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class TcpTransport:
    """Client side: fetch a byte range of a remote tensor into ``dest`` over ``streams`` connections."""

    kind = "tcp"

    def __init__(self, config: WireConfig, *, token: str | None, max_streams: int = 8) -> None:
        self.config = config
        self.token = token
        self._pool = _Pool()
        self._executor = ThreadPoolExecutor(max_workers=max_streams, thread_name_prefix="tensorcast-fetch")

    def serve(self, open_source: SourceOpener, *, corrupt_chunks: int = 0) -> TcpDataServer:
        return TcpDataServer(open_source, self.config, token=self.token, corrupt_chunks=corrupt_chunks)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        with self._pool.lock:
            for conns in self._pool.idle.values():
                for c in conns:
                    c.close()
            self._pool.idle.clear()

    def _connect(self, address: str, deadline: float | None) -> socket.socket:
        with self._pool.lock:
            conns = self._pool.idle.get(address)
            if conns:
                return conns.pop()
        host, port = parse_address(address)
        timeout = self.config.connect_timeout if deadline is None else max(0.001, deadline - time.time())
        try:
            sock = socket.create_connection((host, port), timeout=min(timeout, self.config.connect_timeout))
        except OSError as exc:
            raise Unavailable(f"cannot connect to data plane at {address}: {exc}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            _send_frame(sock, REQUEST, DataHello(protocol_version=PROTOCOL_VERSION, token=self.token))
            env, reply = _recv_frame(sock, self.config.max_frame_bytes)
            if env.kind == ERROR:
                raise error_from_code(reply.code, reply.message)
        except OSError as exc:
            sock.close()
            raise Unavailable(f"data plane at {address}: handshake failed: {exc}") from None
        except BaseException:
            sock.close()
            raise
        return sock

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
        sock = self._connect(address, deadline)
        ok = False
        try:
            left = None if deadline is None else deadline - time.time()
            if left is not None and left <= 0:
                raise DeadlineExceeded("data transfer: deadline passed")
            sock.settimeout(left)
            body = encode_envelope(0, REQUEST, trace_id, deadline, req)
            sock.sendall(pack_header(len(body), 0) + body)
            env, reply = _recv_frame(sock, self.config.max_frame_bytes)
            if env.kind == ERROR:
                raise error_from_code(reply.code, reply.message, trace_id)
            if not isinstance(reply, DataReply) or reply.total != len(dest):
                raise Unavailable(f"data plane at {address} answered {reply!r} for {len(dest)} bytes")
            check = bytearray(8)
            for i, start in enumerate(range(0, reply.total, reply.chunk_bytes)):
                piece = dest[start : start + reply.chunk_bytes]
                _recv_exact(sock, memoryview(check))
                _recv_exact(sock, piece)
                got = xxhash.xxh3_64_intdigest(piece)
                sums[first_chunk + i] = got
                if got != _CHECK.unpack(check)[0]:
                    raise ChunkCorrupted(f"chunk at byte {req.offset + start} of {req.name!r} from {address} "
                                         "failed its checksum")
            ok = True
            return reply.tier
        except TimeoutError:
            raise DeadlineExceeded(f"data transfer from {address}: deadline exceeded", trace_id=trace_id) from None
        except OSError as exc:
            raise Unavailable(f"data transfer from {address} failed: {exc}") from None
        finally:
            if ok:
                sock.settimeout(None)
                self._release(address, sock)
            else:
                sock.close()
