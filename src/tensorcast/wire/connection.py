"""One framed connection: an asyncio ``BufferedProtocol`` that reads payloads straight into their buffers.

Owns: reading frames (header -> body -> payload) out of a staging buffer, handing payload bytes to a
receiver-chosen destination (the socket is ``recv_into`` that buffer directly once the body is known),
writing frames with flow control, and the connection's lifecycle. Protocol violations (bad magic,
oversized body) are answered with a typed error and the connection is closed; they never take the
process down. Does not own: what requests mean (``wire.rpc``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, cast

import msgspec

from tensorcast.config import WireConfig
from tensorcast.errors import InvalidArgument, ResourceExhausted, TensorCastError, Unavailable
from tensorcast.wire.frames import HEADER, pack_header, parse_header
from tensorcast.wire.messages import ErrorReply
from tensorcast.wire.protocol import ERROR, Envelope, Message

__all__ = ["Connection", "Frame", "encode_envelope"]

log = logging.getLogger("tensorcast.wire")

_STAGING = 256 * 1024
_DISCARD = 1024 * 1024
_ENVELOPE_DECODER = msgspec.msgpack.Decoder(Envelope)
_MESSAGE_DECODER = msgspec.msgpack.Decoder(Message)
_ENCODER = msgspec.msgpack.Encoder()


def encode_envelope(request_id: int, kind: int, trace_id: str, deadline: float | None, body: Any) -> bytes:
    raw = msgspec.Raw(_ENCODER.encode(body))
    return _ENCODER.encode(Envelope(request_id, kind, trace_id, deadline, raw))


# A payload destination: one buffer, or several filled in order (scatter), e.g. KV page slots.
Sink = memoryview | list[memoryview]


class Frame:
    """A received frame: the envelope, its decoded message (or the decode error), and the payload."""

    __slots__ = ("envelope", "error", "message", "payload")

    def __init__(
        self,
        envelope: Envelope,
        message: Any,
        error: TensorCastError | None,
        payload: Sink | None,
    ) -> None:
        self.envelope = envelope
        self.message = message
        self.error = error
        self.payload = payload


# Called with the frame's envelope, message and payload length once the body is known; returns the
# destination for the payload, or None to receive it into a fresh buffer (bounded by the config).
SinkChooser = Callable[["Connection", Envelope, Any, int], Sink | None]
FrameHandler = Callable[["Connection", Frame], None]


class Connection(asyncio.BufferedProtocol):
    def __init__(
        self,
        config: WireConfig,
        on_frame: FrameHandler,
        choose_sink: SinkChooser,
        on_lost: Callable[[Connection, Exception | None], None] | None = None,
    ) -> None:
        self.config = config
        self._on_frame = on_frame
        self._choose_sink = choose_sink
        self._on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.Event()
        self.peer: Any = None  # set by the RPC layer after the handshake
        self.authenticated = False
        self._failed = False  # a protocol violation was reported; ignore whatever follows
        self._staging = bytearray(_STAGING)
        self._r = 0
        self._w = 0
        self._state = 0  # 0 header, 1 body, 2 payload
        self._body_len = 0
        self._payload_len = 0
        self._direct: memoryview | None = None  # filled by recv_into directly
        self._direct_pos = 0
        self._direct_done: Callable[[], None] | None = None
        self._big_body: bytearray | None = None
        self._pending: Frame | None = None
        self._sinks: list[memoryview] = []
        self._sink_i = 0
        self._sink_pos = 0
        self._have_sink = False
        self._discard_left = 0
        self._discard_error: TensorCastError | None = None
        self._write_lock = asyncio.Lock()
        self._can_write = asyncio.Event()
        self._can_write.set()

    # ------------------------------------------------------------------ asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, hence the cast.
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(high=2 * self.config.send_chunk_bytes)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set()
        self._can_write.set()
        if self._on_lost is not None:
            self._on_lost(self, exc)

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._failed:  # drain into the staging buffer until the transport closes
            self._r = self._w = 0
            return memoryview(self._staging)
        if self._direct is not None:
            return self._direct[self._direct_pos :]
        if self._r == self._w:
            self._r = self._w = 0
        elif self._w == len(self._staging):
            pending = self._w - self._r
            self._staging[:pending] = self._staging[self._r : self._w]
            self._r, self._w = 0, pending
        return memoryview(self._staging)[self._w :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._failed:
            return
        try:
            if self._direct is not None:
                self._direct_pos += nbytes
                if self._direct_pos < len(self._direct):
                    return
                self._direct = None
                done, self._direct_done = self._direct_done, None
                assert done is not None
                done()
            else:
                self._w += nbytes
            self._process()
        except TensorCastError as exc:
            self.fail(exc)
        except Exception as exc:  # a bug must not kill the event loop
            log.exception("connection reader failed")
            self.fail(InvalidArgument(f"connection reader failed: {exc}"))

    # ------------------------------------------------------------------ frame parsing

    def _process(self) -> None:
        while self._direct is None and not self._failed and not self.closed.is_set():
            avail = self._w - self._r
            if self._state == 0:
                if avail < HEADER.size:
                    return
                hdr = parse_header(memoryview(self._staging)[self._r : self._r + HEADER.size],
                                   self.config.max_frame_bytes)
                self._r += HEADER.size
                self._body_len, self._payload_len = hdr
                self._state = 1
            elif self._state == 1:
                if self._body_len > len(self._staging):
                    self._big_body = bytearray(self._body_len)
                    self._big_body[:avail] = self._staging[self._r : self._w]
                    self._r = self._w
                    self._start_direct(memoryview(self._big_body), avail, self._big_body_done)
                    return
                if avail < self._body_len:
                    return
                body = bytes(self._staging[self._r : self._r + self._body_len])
                self._r += self._body_len
                self._body_done(body)
            else:
                self._pump_payload()

    def _big_body_done(self) -> None:
        body, self._big_body = bytes(self._big_body or b""), None
        self._body_done(body)

    def _body_done(self, body: bytes) -> None:
        try:
            env = _ENVELOPE_DECODER.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise InvalidArgument(f"malformed frame body: {exc}") from exc
        message: Any = None
        error: TensorCastError | None = None
        try:
            message = _MESSAGE_DECODER.decode(env.body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            error = InvalidArgument(f"unknown or malformed message: {exc}", trace_id=env.trace_id)
        frame = Frame(env, message, error, None)
        if self._payload_len == 0:
            self._state = 0
            self._on_frame(self, frame)
            return
        sink: Sink | None = None
        if error is None:
            try:
                sink = self._choose_sink(self, env, message, self._payload_len)
            except TensorCastError as exc:
                error = exc
                frame.error = exc
        if error is not None:
            # Consume the payload without keeping it, then report the error for this request only.
            self._discard_left = self._payload_len
            self._pending = frame
        else:
            if sink is None:
                if self._payload_len > self.config.max_unsolicited_payload_bytes:
                    raise ResourceExhausted(
                        f"payload of {self._payload_len} bytes exceeds the limit of "
                        f"{self.config.max_unsolicited_payload_bytes} bytes"
                    )
                sink = memoryview(bytearray(self._payload_len))
            views = sink if isinstance(sink, list) else [sink]
            total = sum(v.nbytes for v in views)
            if total != self._payload_len:
                raise InvalidArgument(
                    f"payload of {self._payload_len} bytes does not match its {total}-byte destination"
                )
            self._sinks = [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in views if v.nbytes]
            self._sink_i, self._sink_pos, self._have_sink = 0, 0, True
            frame.payload = sink
            self._pending = frame
        self._state = 2

    def _pump_payload(self) -> None:
        if self._have_sink:
            while self._sink_i < len(self._sinks):
                view = self._sinks[self._sink_i]
                avail = self._w - self._r
                take = min(avail, len(view) - self._sink_pos)
                view[self._sink_pos : self._sink_pos + take] = self._staging[self._r : self._r + take]
                self._r += take
                self._sink_pos += take
                if self._sink_pos < len(view):
                    self._start_direct(view, self._sink_pos, self._sink_view_done)
                    return
                self._sink_i, self._sink_pos = self._sink_i + 1, 0
        else:
            avail = self._w - self._r
            take = min(avail, self._discard_left)
            self._r += take
            self._discard_left -= take
            if self._discard_left > 0:
                scratch = memoryview(bytearray(min(_DISCARD, self._discard_left)))
                self._start_direct(scratch, 0, self._discard_chunk_done)
                return
        self._payload_done()

    def _sink_view_done(self) -> None:
        self._sink_i, self._sink_pos = self._sink_i + 1, 0
        self._pump_payload()

    def _discard_chunk_done(self) -> None:
        self._discard_left -= self._direct_pos
        if self._discard_left > 0:
            scratch = memoryview(bytearray(min(_DISCARD, self._discard_left)))
            self._start_direct(scratch, 0, self._discard_chunk_done)
        else:
            self._payload_done()

    def _payload_done(self) -> None:
        frame, self._pending = self._pending, None
        self._sinks, self._have_sink = [], False
        self._state = 0
        assert frame is not None
        self._on_frame(self, frame)

    def _start_direct(self, target: memoryview, pos: int, done: Callable[[], None]) -> None:
        self._direct, self._direct_pos, self._direct_done = target, pos, done
        if pos >= len(target):
            self._direct = None
            self._direct_done = None
            done()

    # ------------------------------------------------------------------ writing

    async def send(self, body: bytes, payload: Sink | None = None) -> None:
        """Write one frame; the payload (one buffer, or several sent back to back) goes in chunks, waiting
        on flow control between them."""
        if self.transport is None or self.closed.is_set():
            raise Unavailable("connection is closed")
        views = [] if payload is None else payload if isinstance(payload, list) else [payload]
        payload_len = sum(v.nbytes for v in views)
        async with self._write_lock:
            if self.closed.is_set():
                raise Unavailable("connection is closed")
            self.transport.write(pack_header(len(body), payload_len) + body)
            step = self.config.send_chunk_bytes
            pending = 0
            for view in views:
                raw = view.cast("B") if view.format != "B" or view.ndim != 1 else view
                for start in range(0, raw.nbytes, step):
                    if pending >= step:
                        await self._can_write.wait()
                        pending = 0
                    if self.closed.is_set():
                        raise Unavailable("connection closed while sending a payload")
                    piece = raw[start : start + step]
                    self.transport.write(piece)
                    pending += piece.nbytes
            await self._can_write.wait()

    def fail(self, exc: TensorCastError) -> None:
        """Report a protocol violation to the peer (best effort) and close the connection."""
        if self._failed:
            return
        self._failed = True
        if self.transport is not None and not self.closed.is_set():
            log.warning("closing connection: %s", exc)
            body = encode_envelope(0, ERROR, exc.trace_id or "", None,
                                   ErrorReply(code=exc.code, message=exc.message, retryable=exc.retryable))
            self.transport.write(pack_header(len(body), 0) + body)
            self.transport.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
