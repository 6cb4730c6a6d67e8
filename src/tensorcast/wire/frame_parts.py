"""What travels on a framed connection, apart from the connection: encoding an envelope, the error reply sent
for a typed error (clipped), payload destinations (``Sink``, ``Landing``), a received ``Frame``, and the two
ways a call can fail to reach its peer (``NotSent``, ``ConnectionLost``). Does not own: reading or writing
frames (``wire.connection``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from tensorcast.errors import InternalError, InvalidArgument, TensorCastError, Unavailable, error_from_code
from tensorcast.wire.messages import ErrorReply
from tensorcast.wire.protocol import Envelope

__all__ = ["ConnectionLost", "Frame", "Landing", "NotSent", "Sink", "checked_reply", "encode_envelope", "error_reply",
           "payload_views", "reported_error"]

_ENCODER = msgspec.msgpack.Encoder()


def encode_envelope(request_id: int, kind: int, trace_id: str, deadline: float | None, body: Any,
                    span_id: int = 0) -> bytes:
    try:
        raw = msgspec.Raw(_ENCODER.encode(body))
    except UnicodeEncodeError as exc:  # a lone surrogate ("a\ud800") in a key or name: not UTF-8, not sendable
        bad = exc.object[exc.start : exc.end] if isinstance(exc.object, str) else ""
        raise InvalidArgument(f"{type(body).__name__}: text with a lone surrogate {bad!r} is not valid UTF-8 "
                              "and cannot be sent") from None
    return _ENCODER.encode(Envelope(request_id, kind, trace_id, deadline, raw, span_id))


# The longest error message sent to a peer (callers' keys and paths are clipped where they are quoted).
_MAX_ERROR_CHARS = 2000


def error_reply(exc: TensorCastError) -> ErrorReply:
    message = exc.message if len(exc.message) <= _MAX_ERROR_CHARS else exc.message[:_MAX_ERROR_CHARS] + "..."
    return ErrorReply(code=exc.code, message=message, retryable=exc.retryable)


def reported_error(message: Any, trace_id: str = "") -> TensorCastError:
    """What an error frame's body says went wrong, as its typed error (``InternalError`` for a body that is no
    ``ErrorReply``, whatever it claims to be)."""
    if isinstance(message, ErrorReply):
        return error_from_code(message.code, message.message, trace_id)
    return InternalError("malformed error reply", trace_id=trace_id)


def checked_reply(request: Any, reply: Any, peer: str, trace_id: str = "") -> Any:
    """``reply`` if it is of the type ``request`` declares; ``InternalError`` naming ``peer`` otherwise."""
    expect = type(request).reply_type()
    if not isinstance(reply, expect):
        raise InternalError(f"{peer} answered {type(request).__name__} with {type(reply).__name__}, expected "
                            f"{expect.__name__}", trace_id=trace_id)
    return reply


# A payload destination: one buffer, or several filled in order (scatter), e.g. KV page slots.
Sink = memoryview | list[memoryview]


def payload_views(payload: Sink | None) -> list[memoryview]:
    """A payload as flat byte views (empty ones dropped)."""
    views = [] if payload is None else payload if isinstance(payload, list) else [payload]
    return [v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in views if v.nbytes]


@dataclass(slots=True)
class Landing:
    """Where a request's payload lands, with what the handler needs about it (``context``), and how to give
    the destination back if the request fails before its handler completes (``discard``)."""

    views: Sink
    context: Any = None
    discard: Callable[[], None] | None = None


class NotSent(Unavailable):
    """The peer could not be reached, so the request was never sent: any request may be sent elsewhere."""


class ConnectionLost(Unavailable):
    """The connection broke while a request was in flight: it may or may not have been carried out."""


class Frame:
    """A received frame: the envelope, its decoded message (or the decode error), the payload, and the
    payload's checksums as sent (verified by the RPC layer)."""

    __slots__ = ("checksums", "envelope", "error", "landing", "message", "payload")

    def __init__(self, envelope: Envelope, message: Any, error: TensorCastError | None) -> None:
        self.envelope = envelope
        self.message = message
        self.error = error
        self.payload: Sink | None = None
        self.checksums: list[int] | None = None
        self.landing: Landing | None = None
