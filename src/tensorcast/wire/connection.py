"""One framed connection: an asyncio ``BufferedProtocol`` that reads payloads straight into their buffers.

Owns: driving a ``wire.frame_reader.FrameReader`` from the socket (its ``get_buffer`` is the protocol's, so
payload bytes are ``recv_into`` the receiver-chosen destination once the body is known), turning its events
into ``Frame`` objects (decoding the body, choosing the payload's destination, refusing a payload with a
request's own error), writing frames with their payload checksums and flow control, and the connection's
lifecycle. The checksums are kept on the frame; the RPC layer checks them before anything uses the
bytes. Protocol violations (bad magic, oversized body) are answered with a typed error and the
connection is closed; they never take the process down. Does not own: parsing frames (``wire.frame_reader``),
what requests mean (``wire.rpc``), or the frame's parts (``wire.frame_parts``, whose names it re-exports).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, cast

from tensorcast.checksums import chunk_checksums, pack_checksums
from tensorcast.config import WireConfig
from tensorcast.errors import InvalidArgument, TensorCastError
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
from tensorcast.wire.frame_reader import Body, Checksums, FrameReader
from tensorcast.wire.frames import CHECKSUMS, pack_header
from tensorcast.wire.protocol import ERROR, Envelope
from tensorcast.wire.shared import WireState
from tensorcast.wire.sockets import detect_dead_peer

__all__ = ["HASH_OFF_LOOP_BYTES", "Connection", "ConnectionLost", "Frame", "Landing", "NotSent", "Sink",
           "encode_envelope", "error_reply", "payload_views"]

log = logging.getLogger("tensorcast.wire")

_STAGING = 256 * 1024
_STAGING_PREAUTH = 4096  # an unauthenticated peer gets no more than this (and max_handshake_bytes)
# Payloads at least this large are checksummed (and verified) off the event loop.
HASH_OFF_LOOP_BYTES = 1024 * 1024
# A payload of at most this many bytes goes out in the same write as its frame's header: one system call,
# one TCP segment, one wake-up of the peer, where a separate write costs each of them again (copying a few
# KiB to join them costs less).
_JOIN_PAYLOAD_BYTES = 64 * 1024


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
        # Until authenticated: small frames only, and no payloads.
        self._reader = FrameReader(_STAGING_PREAUTH, config.max_handshake_bytes, self._shared.budget, payloads=False)
        self._pending: Frame | None = None  # the frame whose payload is arriving
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
        self._reader.max_body = self.config.max_frame_bytes
        self._reader.payloads = True
        self._reader.grow(_STAGING)

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    def get_buffer(self, sizehint: int) -> memoryview:
        # A payload's destination once its body is known (the socket is recv_into it); once failed, the
        # staging buffer, drained into until the transport closes.
        return self._reader.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.heard = True
        if self._failed:
            return
        try:
            self._reader.buffer_updated(nbytes)
            self._process()
        except TensorCastError as exc:
            self.fail(exc)
        except Exception as exc:  # a bug must not kill the event loop, nor a peer flood the log through it
            self._shared.bugs.exception("connection reader failed")
            self.fail(InvalidArgument(f"connection reader failed: {type(exc).__name__}"))

    # ------------------------------------------------------------------ frames read

    def _process(self) -> None:
        reader = self._reader
        while not self._failed and not self.closed.is_set():
            event = reader.next_event()
            if event is None:
                return
            if isinstance(event, Body):
                self._body_done(event)
            elif isinstance(event, Checksums):
                assert self._pending is not None
                self._pending.checksums = event.sums
            else:  # PayloadDone
                frame, self._pending = self._pending, None
                assert frame is not None
                self._on_frame(self, frame)  # from here the payload's buffer is the handler's (or the caller's)

    def _body_done(self, event: Body) -> None:
        env = decode_envelope(event.body)  # an undecodable envelope ends the connection (InvalidArgument)
        try:
            frame = Frame(env, decode_message(env.body), None)
        except InvalidArgument as exc:  # this request's error only
            frame = Frame(env, None, InvalidArgument(exc.message, trace_id=env.trace_id))
        if event.payload_len == 0:
            self._on_frame(self, frame)
            return
        self._pending = frame
        if frame.error is None and not event.checksums:
            frame.error = InvalidArgument("a payload must come with its chunk checksums", trace_id=env.trace_id)
        if frame.error is None:
            try:
                self._land(frame, event.payload_len)
            except TensorCastError as exc:
                frame.error = exc
        if frame.error is not None:
            # Consume the payload (and its checksums) without keeping it; the error is this request's only.
            self._reader.skip()

    def _land(self, frame: Frame, payload_len: int) -> None:
        """Choose where the payload goes (the request's sink, or a bounded fresh buffer)."""
        chosen = self._choose_sink(self, frame.envelope, frame.message, payload_len)
        landing = chosen if isinstance(chosen, Landing) else None
        sink: Sink | None = chosen.views if isinstance(chosen, Landing) else chosen
        try:
            if sink is None:
                sink = self._reader.land_fresh(self.config.max_unsolicited_payload_bytes)
            else:
                self._reader.land(payload_views(sink))
        except BaseException:
            if landing is not None and landing.discard is not None:
                landing.discard()
            raise
        frame.payload, frame.landing = sink, landing

    def _drop_pending(self) -> None:
        """The connection ended mid-frame: give back the destination its payload was landing in, and let go
        of every buffer (a closed connection must not keep memory alive)."""
        frame, self._pending = self._pending, None
        if frame is not None and frame.landing is not None and frame.landing.discard is not None:
            frame.landing.discard()
        self._reader.close()

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
            frame = pack_header(len(body), payload_len, CHECKSUMS if payload_len else 0) + body + head
            if payload_len <= _JOIN_PAYLOAD_BYTES:
                self.transport.write(b"".join((frame, *views)) if views else frame)
                views = []
            else:
                self.transport.write(frame)
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
