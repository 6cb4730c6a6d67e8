"""One framed connection: an asyncio ``BufferedProtocol`` that reads payloads straight into their buffers.

Owns: reading frames (header -> body -> payload checksums -> payload) out of a staging buffer, handing
payload bytes to a receiver-chosen destination (the socket is ``recv_into`` that buffer directly once the
body is known), writing frames with their payload checksums and flow control, and the connection's
lifecycle. The checksums are kept on the frame; the RPC layer checks them before anything uses the
bytes. Protocol violations (bad magic, oversized body) are answered with a typed error and the
connection is closed; they never take the process down. Does not own: what requests mean (``wire.rpc``), or
the frame's parts (``wire.frame_parts``, whose names it re-exports).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, cast

from tensorcast.checksums import chunk_checksums, chunk_count, pack_checksums, unpack_checksums
from tensorcast.config import WireConfig
from tensorcast.errors import InvalidArgument, ResourceExhausted, TensorCastError, Unauthenticated
from tensorcast.wire.codec import decode_envelope, decode_message
from tensorcast.wire.frame_parts import (
    ConnectionLost,
    Frame,
    Landing,
    NotSent,
    Sink,
    encode_envelope,
    error_reply,
    payload_views,
)
from tensorcast.wire.frames import CHECKSUMS, HEADER, pack_header, parse_header
from tensorcast.wire.protocol import ERROR, Envelope
from tensorcast.wire.shared import WireState
from tensorcast.wire.sockets import detect_dead_peer

__all__ = ["HASH_OFF_LOOP_BYTES", "Connection", "ConnectionLost", "Frame", "Landing", "NotSent", "Sink",
           "encode_envelope", "error_reply", "payload_views"]

log = logging.getLogger("tensorcast.wire")

_STAGING = 256 * 1024
_STAGING_PREAUTH = 4096  # an unauthenticated peer gets no more than this (and max_handshake_bytes)
_DISCARD = 1024 * 1024
# Payloads at least this large are checksummed (and verified) off the event loop.
HASH_OFF_LOOP_BYTES = 1024 * 1024
_HEADER, _BODY, _PAYLOAD, _SUMS = 0, 1, 2, 3


# Called with the frame's envelope, message and payload length once the body is known; returns the
# destination for the payload, or None to receive it into a fresh buffer (bounded by the config).
SinkChooser = Callable[["Connection", Envelope, Any, int], Sink | Landing | None]
FrameHandler = Callable[["Connection", Frame], None]


class Connection(asyncio.BufferedProtocol):
    def __init__(
        self,
        config: WireConfig,
        on_frame: FrameHandler,
        choose_sink: SinkChooser,
        on_lost: Callable[[Connection, Exception | None], None] | None = None,
        shared: WireState | None = None,
    ) -> None:
        self.config = config
        self._on_frame = on_frame
        self._choose_sink = choose_sink
        self._on_lost = on_lost
        self._shared = shared or WireState(config)
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.Event()
        self.peer: Any = None  # set by the RPC layer after the handshake
        self.role = ""  # the peer's credential's role, once authenticated (``credentials``)
        self.handshake: Any = None  # the server's handshake state (``wire.handshake``) until authenticated
        self.authenticated = False
        self.heard = False  # a byte has arrived (the server closes silent sockets before a peer mid-handshake)
        # Server side: called once the transport is there (to start TLS on it); until TLS is up, nothing is
        # written in clear into what the peer takes for a TLS stream.
        self.on_made: Callable[[Connection], None] | None = None
        self.tls_pending = False
        self.handshake_timer: asyncio.TimerHandle | None = None  # cancelled once authenticated or closed
        self._failed = False  # a protocol violation was reported; ignore whatever follows
        self._staging = bytearray(_STAGING_PREAUTH)
        self._held = 0  # bytes of the shared receive budget this connection holds
        self._r = 0
        self._w = 0
        self._state = _HEADER
        self._flags = 0
        self._body_len = 0
        self._payload_len = 0
        self._direct: memoryview | None = None  # filled by recv_into directly
        self._direct_pos = 0
        self._direct_done: Callable[[], None] | None = None
        self._big: bytearray | None = None  # a body or checksum block larger than what is staged
        self._pending: Frame | None = None
        self._sinks: list[memoryview] = []
        self._sink_i = 0
        self._sink_pos = 0
        self._discard_left = 0
        self._write_lock = asyncio.Lock()
        self._can_write = asyncio.Event()
        self._can_write.set()

    # ------------------------------------------------------------------ asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, hence the cast.
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(high=2 * self.config.send_chunk_bytes)
        sock = transport.get_extra_info("socket")
        if sock is not None and self.config.dead_peer_timeout > 0:
            detect_dead_peer(sock, self.config.dead_peer_timeout)
        if self.on_made is not None:
            self.on_made(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set()
        self._can_write.set()
        self._drop_pending()
        if self.handshake_timer is not None:
            self.handshake_timer.cancel()
            self.handshake_timer = None
        if self._on_lost is not None:
            self._on_lost(self, exc)

    def scratch(self, nbytes: int) -> tuple[memoryview, Callable[[], None]]:
        """A fresh buffer for payload bytes a handler will drop (a page already stored), charged to the
        process's receive budget (``ResourceExhausted`` beyond it) until the returned release runs."""
        self._shared.budget.take(nbytes)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._shared.budget.give(nbytes)

        return memoryview(bytearray(nbytes)), release

    def authenticate(self, peer: Any = None) -> None:
        """The handshake succeeded: frames up to ``wire.max_frame_bytes`` and payloads are accepted now."""
        self.authenticated = True
        self.peer = peer
        if self.handshake_timer is not None:
            self.handshake_timer.cancel()
            self.handshake_timer = None
        if len(self._staging) < _STAGING:
            staged = self._staging[self._r : self._w]
            self._staging = bytearray(_STAGING)
            self._staging[: len(staged)] = staged
            self._r, self._w = 0, len(staged)

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
        self.heard = True
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
        except Exception as exc:  # a bug must not kill the event loop, nor a peer flood the log through it
            self._shared.bugs.exception("connection reader failed")
            self.fail(InvalidArgument(f"connection reader failed: {type(exc).__name__}"))

    # ------------------------------------------------------------------ frame parsing

    def _process(self) -> None:
        while self._direct is None and not self._failed and not self.closed.is_set():
            avail = self._w - self._r
            if self._state == _HEADER:
                if avail < HEADER.size:
                    return
                head = memoryview(self._staging)[self._r : self._r + HEADER.size]
                limit = self.config.max_frame_bytes if self.authenticated else self.config.max_handshake_bytes
                self._flags, self._body_len, self._payload_len = parse_header(head, limit)
                if self._payload_len and not self.authenticated:
                    raise Unauthenticated("a payload before the handshake")
                self._r += HEADER.size
                self._state = _BODY
            elif self._state == _BODY:
                if not self._take_block(self._body_len, self._big_body_done):
                    return
                body = bytes(self._staging[self._r : self._r + self._body_len])
                self._r += self._body_len
                self._body_done(body)
            elif self._state == _SUMS:
                n = 8 * chunk_count(self._payload_len)
                if not self._take_block(n, self._big_sums_done):
                    return
                self._sums_done(bytes(self._staging[self._r : self._r + n]))
                self._r += n
            else:
                self._pump_payload()

    def _take_block(self, size: int, done: Callable[[], None]) -> bool:
        """True when ``size`` bytes are staged; a block larger than the staging buffer is read directly
        into a buffer of its own (then ``done`` runs, and False is returned)."""
        avail = self._w - self._r
        if size <= len(self._staging):
            return avail >= size
        self._hold(size)
        self._big = bytearray(size)
        self._big[:avail] = self._staging[self._r : self._w]
        self._r = self._w
        self._start_direct(memoryview(self._big), avail, done)
        return False

    def _big_body_done(self) -> None:
        body, self._big = bytes(self._big or b""), None
        self._release()
        self._body_done(body)

    def _big_sums_done(self) -> None:
        sums, self._big = bytes(self._big or b""), None
        self._release()
        self._sums_done(sums)

    def _hold(self, nbytes: int) -> None:
        self._shared.budget.take(nbytes)
        self._held += nbytes

    def _release(self) -> None:
        self._shared.budget.give(self._held)
        self._held = 0

    def _body_done(self, body: bytes) -> None:
        env = decode_envelope(body)  # an undecodable envelope ends the connection (InvalidArgument)
        try:
            frame = Frame(env, decode_message(env.body), None)
        except InvalidArgument as exc:  # this request's error only
            frame = Frame(env, None, InvalidArgument(exc.message, trace_id=env.trace_id))
        if self._payload_len == 0:
            self._state = _HEADER
            self._on_frame(self, frame)
            return
        self._pending = frame
        sums = bool(self._flags & CHECKSUMS)
        if frame.error is None and not sums:
            frame.error = InvalidArgument("a payload must come with its chunk checksums", trace_id=env.trace_id)
        if frame.error is None:
            try:
                self._land(frame)
            except TensorCastError as exc:
                frame.error = exc
        if frame.error is not None:
            # Consume the payload (and its checksums) without keeping it; the error is this request's only.
            self._discard_left = self._payload_len + (8 * chunk_count(self._payload_len) if sums else 0)
            self._state = _PAYLOAD
        else:
            self._state = _SUMS if sums else _PAYLOAD

    def _land(self, frame: Frame) -> None:
        """Choose where the payload goes (the request's sink, or a bounded fresh buffer)."""
        chosen = self._choose_sink(self, frame.envelope, frame.message, self._payload_len)
        landing = chosen if isinstance(chosen, Landing) else None
        sink: Sink | None = chosen.views if isinstance(chosen, Landing) else chosen
        try:
            if sink is None:
                if self._payload_len > self.config.max_unsolicited_payload_bytes:
                    raise ResourceExhausted(f"payload of {self._payload_len} bytes exceeds the limit of "
                                            f"{self.config.max_unsolicited_payload_bytes} bytes")
                self._hold(self._payload_len)
                sink = memoryview(bytearray(self._payload_len))
            views = payload_views(sink)
            total = sum(v.nbytes for v in views)
            if total != self._payload_len:
                raise InvalidArgument(f"payload of {self._payload_len} bytes does not match its {total}-byte "
                                      "destination")
        except BaseException:
            if landing is not None and landing.discard is not None:
                landing.discard()
            raise
        self._sinks, self._sink_i, self._sink_pos = views, 0, 0
        frame.payload, frame.landing = sink, landing

    def _sums_done(self, raw: bytes) -> None:
        assert self._pending is not None
        self._pending.checksums = unpack_checksums(raw)
        self._state = _PAYLOAD

    def _pump_payload(self) -> None:
        if self._discard_left:
            avail = self._w - self._r
            take = min(avail, self._discard_left)
            self._r += take
            self._discard_left -= take
            if self._discard_left > 0:
                self._start_direct(memoryview(bytearray(min(_DISCARD, self._discard_left))), 0,
                                   self._discard_chunk_done)
                return
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
        self._payload_done()

    def _sink_view_done(self) -> None:
        self._sink_i, self._sink_pos = self._sink_i + 1, 0
        self._pump_payload()

    def _discard_chunk_done(self) -> None:
        self._discard_left -= self._direct_pos
        self._pump_payload()

    def _payload_done(self) -> None:
        frame, self._pending = self._pending, None
        self._sinks = []
        self._state = _HEADER
        self._release()  # the frame is complete: from here its buffer is the handler's (or the caller's)
        assert frame is not None
        self._on_frame(self, frame)

    def _start_direct(self, target: memoryview, pos: int, done: Callable[[], None]) -> None:
        assert pos < len(target)
        self._direct, self._direct_pos, self._direct_done = target, pos, done

    def _drop_pending(self) -> None:
        """The connection ended mid-frame: give back the destination its payload was landing in, and let go
        of every buffer (a closed connection must not keep memory alive)."""
        frame, self._pending = self._pending, None
        if frame is not None and frame.landing is not None and frame.landing.discard is not None:
            frame.landing.discard()
        self._sinks, self._big, self._direct, self._direct_done = [], None, None, None
        self._release()

    # ------------------------------------------------------------------ writing

    async def send(self, body: bytes, payload: Sink | None = None) -> None:
        """Write one frame; the payload (one buffer, or several sent back to back) goes after its chunk
        checksums, in pieces, waiting on flow control between them."""
        if self.transport is None or self.closed.is_set():
            raise NotSent("connection is closed")
        views = payload_views(payload)
        payload_len = sum(v.nbytes for v in views)
        head = b""
        if payload_len:
            sums = chunk_checksums(views) if payload_len < HASH_OFF_LOOP_BYTES else \
                await asyncio.to_thread(chunk_checksums, views)
            head = pack_checksums(sums)
            if self._shared.faults.take():
                bad = bytearray(views[0])
                bad[len(bad) // 2] ^= 0xFF
                views = [memoryview(bad), *views[1:]]
        async with self._write_lock:
            if self.closed.is_set():
                raise NotSent("connection is closed")
            self.transport.write(pack_header(len(body), payload_len, CHECKSUMS if payload_len else 0) + body + head)
            step = self.config.send_chunk_bytes
            pending = 0
            for raw in views:
                for start in range(0, raw.nbytes, step):
                    if pending >= step:
                        await self._can_write.wait()
                        pending = 0
                    if self.closed.is_set():
                        raise ConnectionLost("connection closed while sending a payload")
                    piece = raw[start : start + step]
                    self.transport.write(piece)
                    pending += piece.nbytes
            await self._can_write.wait()

    def fail(self, exc: TensorCastError) -> None:
        """Report a protocol violation to the peer (best effort) and close the connection."""
        if self._failed:
            return
        self._failed = True
        self._drop_pending()
        if self.transport is not None and not self.closed.is_set():
            self._shared.violations.warning("closing connection: %s", exc)
            if not self.tls_pending:
                body = encode_envelope(0, ERROR, exc.trace_id or "", None, error_reply(exc))
                self.transport.write(pack_header(len(body), 0) + body)
            self.transport.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
