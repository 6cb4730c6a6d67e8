"""Decoding frame bodies from untrusted peers: the envelope and the message union, every failure typed.

Owns: the one pair of decoders every receiver uses (the control RPC's connections and the data plane's
server and client) and what a body that cannot be decoded becomes — ``InvalidArgument``, never another
exception: msgpack nested deeper than the decoder's recursion limit raises ``RecursionError``, which
escaped a receive loop before (one 3 KB frame stopped a worker's data server). Does not own: framing
(``wire.frames``) or what a message means.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tensorcast.errors import InvalidArgument
from tensorcast.wire.protocol import Envelope, Message

__all__ = ["decode_envelope", "decode_message"]

_ENVELOPE = msgspec.msgpack.Decoder(Envelope)
_MESSAGE = msgspec.msgpack.Decoder(Message)
# What a malformed body raises while being decoded: bad msgpack, the wrong types, or nesting too deep.
_MALFORMED = (msgspec.DecodeError, msgspec.ValidationError, RecursionError, ValueError, OverflowError)


def decode_envelope(body: bytes | bytearray | memoryview) -> Envelope:
    try:
        return _ENVELOPE.decode(body)
    except _MALFORMED as exc:
        raise InvalidArgument(f"malformed frame body: {_why(exc)}") from None


def decode_message(raw: bytes | bytearray | memoryview | msgspec.Raw) -> Any:
    try:
        return _MESSAGE.decode(raw)
    except _MALFORMED as exc:
        raise InvalidArgument(f"unknown or malformed message: {_why(exc)}") from None


def _why(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):
        return "nested too deep"
    return str(exc)[:200]
