"""Blocking frame I/O on data-plane sockets, shared by the TCP data server and its client.

Owns: reading exactly N bytes into a buffer (by an absolute deadline, if given), reading one control frame
(``DataHello``, ``DataRequest``, ``DataReply`` or an error; they carry no payload), writing one, and the
8-byte chunk checksum prefix. Malformed frames raise typed errors. Does not own: what the frames mean.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from typing import Any

from tensorcast.errors import InvalidArgument, TensorCastError, Unavailable
from tensorcast.wire.codec import decode_envelope, decode_message
from tensorcast.wire.connection import encode_envelope, error_reply
from tensorcast.wire.frames import HEADER, pack_header, parse_header
from tensorcast.wire.protocol import ERROR, Envelope

__all__ = ["CHECKSUM", "PeerClosed", "decode_frame", "recv_exact", "recv_frame", "send_error", "send_frame"]


class PeerClosed(Unavailable):
    """The peer closed the connection before every byte expected arrived."""


CHECKSUM = struct.Struct(">Q")  # the xxh3-64 of a chunk, sent before it


def recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view`` from ``sock``. With ``deadline`` (``time.time()``), ``TimeoutError`` once it passes: each
    receive waits only for the time left, since a socket timeout alone restarts with every receive and a peer
    that trickles bytes (or a lossy link in TCP backoff) would hold the read past any deadline."""
    pos, n = 0, len(view)
    while pos < n:
        if deadline is not None:
            left = deadline - time.time()
            if left <= 0:
                raise TimeoutError("deadline passed while receiving")
            sock.settimeout(left)
        got = sock.recv_into(view[pos:])
        if got == 0:
            raise PeerClosed("data connection closed by peer mid-transfer")
        pos += got


def decode_frame(body: bytes | bytearray | memoryview) -> tuple[Envelope, Any]:
    """The envelope and message of a data-plane frame; ``InvalidArgument`` for anything malformed."""
    env = decode_envelope(body)
    return env, decode_message(env.body)


def recv_frame(sock: socket.socket, max_body: int, deadline: float | None = None) -> tuple[Envelope, Any]:
    hdr = bytearray(HEADER.size)
    recv_exact(sock, memoryview(hdr), deadline)
    _flags, body_len, payload_len = parse_header(bytes(hdr), max_body)
    if payload_len:
        raise InvalidArgument("data-plane control frames carry no payload")
    body = bytearray(body_len)
    recv_exact(sock, memoryview(body), deadline)
    return decode_frame(body)


def send_frame(sock: socket.socket, kind: int, message: Any, trace_id: str = "",
               deadline: float | None = None) -> None:
    body = encode_envelope(0, kind, trace_id, deadline, message)
    sock.sendall(pack_header(len(body), 0) + body)


def send_error(sock: socket.socket, exc: TensorCastError) -> None:
    """Best effort: tell the peer why (typed), before the connection is closed."""
    with contextlib.suppress(OSError):
        send_frame(sock, ERROR, error_reply(exc))
