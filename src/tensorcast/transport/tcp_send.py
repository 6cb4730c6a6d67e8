"""Sending one requested range on a data-plane connection (a sender thread of ``transport.tcp_server``).

Owns: opening the request's source, the ``DataReply`` and the range's chunks, each preceded by its xxh3-64
checksum (cached per blob where possible; else computed as the chunk is sent and handed back to the source,
``SourceLease.learn``), a typed error for a request that cannot be served (a bug's too), the counts of bytes
sent and ranges in flight, and the fault injection of tests (``corrupt_chunks``). Does not own: the
connection (``transport.tcp_server``) or which bytes a request names (``open_source``).
"""

from __future__ import annotations

import logging
import socket
import threading

import xxhash

from tensorcast.checksums import CHUNK_BYTES
from tensorcast.errors import InternalError, InvalidArgument, TensorCastError
from tensorcast.log import RateLimitedLog
from tensorcast.transport.base import SourceOpener
from tensorcast.transport.tcp_frames import CHECKSUM, send_error, send_frame
from tensorcast.wire.messages import DataReply, DataRequest
from tensorcast.wire.protocol import RESPONSE

__all__ = ["RangeSender"]

log = logging.getLogger("tensorcast.transport")


class RangeSender:
    """Sends ranges for one data server, from any of its sender threads."""

    def __init__(self, open_source: SourceOpener, corrupt_chunks: int = 0) -> None:
        self.open_source = open_source
        self._corrupt_left = corrupt_chunks  # flip one byte in each of the next N chunks sent
        self._lock = threading.Lock()
        self._bugs = RateLimitedLog(log)
        self.bytes_sent = 0
        self.active = 0

    def send(self, conn: socket.socket, req: DataRequest, trace_id: str) -> None:
        """Answer ``req`` on ``conn`` (blocking): a ``DataReply`` and the range's chunks, or a typed error."""
        try:
            lease = self.open_source(req)
        except TensorCastError as exc:
            send_error(conn, exc)
            return
        except Exception as exc:  # every request gets an answer, a bug's too
            self._bugs.exception("opening the source of a data request")
            send_error(conn, InternalError(f"data request failed: {type(exc).__name__}"))
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
