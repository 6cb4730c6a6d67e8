"""Frame layout: a fixed 16-byte header, a msgpack body, an optional raw payload.

::

    offset  size  field
    0       2     magic  b"TC"
    2       1     protocol version (messages.PROTOCOL_VERSION)
    3       1     flags: bit 0 (CHECKSUMS) = payload checksums follow the body
    4       4     body length, big-endian u32   (<= wire.max_frame_bytes)
    8       8     payload length, big-endian u64

then the body, then (with CHECKSUMS) 8 bytes per ``checksums.CHUNK_BYTES`` chunk of the payload (xxh3-64,
little-endian), then the payload. The body is an ``Envelope``; the payload is tensor bytes that the
receiver reads straight into a buffer it chose from the body (a shared-memory segment, KV page slots, a
caller's array), so bulk bytes are never parsed or copied through msgpack, and checks against the
checksums before anything uses them. This module only packs and checks headers.
"""

from __future__ import annotations

import struct

from tensorcast.errors import InvalidArgument, ResourceExhausted
from tensorcast.wire.messages import PROTOCOL_VERSION

__all__ = ["CHECKSUMS", "HEADER", "MAGIC", "pack_header", "parse_header"]

MAGIC = b"TC"
HEADER = struct.Struct("!2sBBIQ")
CHECKSUMS = 0x01
_KNOWN_FLAGS = CHECKSUMS
_TLS = (b"\x15", b"\x16")  # the first byte of a TLS alert or handshake record


def pack_header(body_len: int, payload_len: int, flags: int = 0) -> bytes:
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, flags, body_len, payload_len)


def parse_header(data: bytes | memoryview, max_body: int) -> tuple[int, int, int]:
    """Validate a header; return (flags, body length, payload length). Raise ``InvalidArgument`` (garbage)
    or ``ResourceExhausted`` (too big)."""
    magic, version, flags, body_len, payload_len = HEADER.unpack(data)
    if magic != MAGIC:
        tls = " (a TLS record: the peer speaks TLS and this side does not; tls.enabled)" if magic[:1] in _TLS else ""
        raise InvalidArgument(f"malformed frame: bad magic {bytes(magic)!r}{tls}")
    if version != PROTOCOL_VERSION:
        raise InvalidArgument(f"unsupported protocol version {version} (this side speaks {PROTOCOL_VERSION})")
    if flags & ~_KNOWN_FLAGS:
        raise InvalidArgument(f"malformed frame: unknown flags {flags:#x}")
    if body_len > max_body:
        raise ResourceExhausted(f"frame body of {body_len} bytes exceeds the limit of {max_body} bytes")
    return flags, body_len, payload_len
