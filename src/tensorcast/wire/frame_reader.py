"""Reading frames out of a byte stream, without the stream: a sans-IO parser that names the buffer the next
bytes go into and turns what arrived into events.

Owns: the frame state machine (header -> body -> payload checksums -> payload), the staging buffer that
headers, bodies and checksum blocks are parsed out of, the header checks (bad magic, version, flags, a body
over ``max_body``, a payload before payloads are accepted), landing a payload in destinations the receiver
chose (its bytes go straight into them: ``get_buffer`` hands them out once the body is known, so the socket
is ``recv_into`` them), a bounded fresh buffer for a payload nobody chose a destination for, discarding a
refused payload, and charging the receive budget for what it allocates (a body or checksum block larger than
the staging buffer, a fresh payload buffer) until the frame is complete. Does not own: sockets or asyncio
(``wire.connection`` drives it as an ``asyncio.BufferedProtocol``), what a body means (``wire.codec``), or
where a request's payload should go (the connection's sink chooser).

Driving it: write into ``get_buffer()``, report the count with ``buffer_updated``, then take events from
``next_event()`` until it returns None. After a ``Body`` with a payload, call ``land``, ``land_fresh`` or
``skip`` before asking for the next event.
"""

from __future__ import annotations

from dataclasses import dataclass

from tensorcast.checksums import chunk_count, unpack_checksums
from tensorcast.errors import InvalidArgument, ResourceExhausted, Unauthenticated
from tensorcast.wire.frames import CHECKSUMS, HEADER, parse_header
from tensorcast.wire.shared import ReceiveBudget

__all__ = ["Body", "Checksums", "Event", "FrameReader", "PayloadDone"]

_DISCARD = 1024 * 1024
_HEADER, _BODY, _LANDING, _SUMS, _PAYLOAD = 0, 1, 2, 3, 4


@dataclass(slots=True)
class Body:
    """A frame's body arrived (its header passed the checks; what else the header said is here too). With
    ``payload_len`` > 0 the reader waits for the payload's destination (``land``, ``land_fresh``) or for
    ``skip``; ``checksums``: the payload's chunk checksums come first."""

    body: bytes
    payload_len: int
    checksums: bool


@dataclass(slots=True)
class Checksums:
    """A landed payload's chunk checksums, as sent (checked by the RPC layer before the bytes are used)."""

    sums: list[int]


@dataclass(slots=True)
class PayloadDone:
    """The payload filled its destination (or was discarded): the frame is complete."""


# No event for the header alone: it would cost each frame an object and a call, and say nothing the
# body's event does not (the header is checked as it arrives).
Event = Body | Checksums | PayloadDone
_DONE = PayloadDone()


class FrameReader:
    """One connection's incoming frames. ``max_body``: the largest body accepted; ``payloads``: whether a
    frame may carry a payload (``Unauthenticated`` otherwise). Both may change between frames (the handshake
    raises them)."""

    def __init__(self, staging_bytes: int, max_body: int, budget: ReceiveBudget, *, payloads: bool = True) -> None:
        self.max_body = max_body
        self.payloads = payloads
        self._budget = budget
        self._staging = bytearray(staging_bytes)
        self._held = 0  # bytes of the shared receive budget this reader holds
        self._r = 0
        self._w = 0
        self._state = _HEADER
        self._closed = False
        self._flags = 0
        self._body_len = 0
        self._payload_len = 0
        self._direct: memoryview | None = None  # filled by recv_into directly
        self._direct_pos = 0
        self._big: bytearray | None = None  # a body or checksum block larger than what is staged
        self._sinks: list[memoryview] = []
        self._sink_i = 0
        self._sink_pos = 0
        self._discard_left = 0

    # ------------------------------------------------------------------ bytes in

    def get_buffer(self) -> memoryview:
        """Where the next bytes go: the rest of a direct target (a payload destination, a large block), or the
        free end of the staging buffer. Once closed, the staging buffer, to drain into and forget."""
        if self._closed:
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
        """``nbytes`` were written at the start of the last ``get_buffer()``."""
        if self._closed:
            return
        if self._direct is not None:
            self._direct_pos += nbytes
        else:
            self._w += nbytes

    def grow(self, staging_bytes: int) -> None:
        """Enlarge the staging buffer (after the handshake), keeping what is staged."""
        if len(self._staging) < staging_bytes:
            staged = self._staging[self._r : self._w]
            self._staging = bytearray(staging_bytes)
            self._staging[: len(staged)] = staged
            self._r, self._w = 0, len(staged)

    def close(self) -> None:
        """Let go of every buffer and give back the budget (the connection ended or failed); what arrives
        from now on is drained and ignored."""
        self._closed = True
        self._sinks, self._big, self._direct = [], None, None
        self._release()

    # ------------------------------------------------------------------ events out

    def next_event(self) -> Event | None:
        """The next event, or None until more bytes arrive."""
        if self._closed:
            return None
        if self._direct is not None:
            return None if self._direct_pos < len(self._direct) else self._direct_filled()
        while True:
            avail = self._w - self._r
            if self._state == _HEADER:
                if avail < HEADER.size:
                    return None
                head = memoryview(self._staging)[self._r : self._r + HEADER.size]
                self._flags, self._body_len, self._payload_len = parse_header(head, self.max_body)
                if self._payload_len and not self.payloads:
                    raise Unauthenticated("a payload before the handshake")
                self._r += HEADER.size
                self._state = _BODY
            elif self._state == _BODY:
                if not self._take_block(self._body_len):
                    return None
                body = bytes(self._staging[self._r : self._r + self._body_len])
                self._r += self._body_len
                return self._body(body)
            elif self._state == _SUMS:
                n = 8 * chunk_count(self._payload_len)
                if not self._take_block(n):
                    return None
                raw = bytes(self._staging[self._r : self._r + n])
                self._r += n
                return self._sums(raw)
            elif self._state == _LANDING:
                raise RuntimeError("the payload's destination is not chosen (land, land_fresh or skip)")
            else:
                return self._pump_payload()

    # ------------------------------------------------------------------ the payload's destination

    def land(self, views: list[memoryview]) -> None:
        """The payload of the last ``Body`` goes into ``views`` (flat byte views), in order."""
        assert self._state == _LANDING
        total = sum(v.nbytes for v in views)
        if total != self._payload_len:
            raise InvalidArgument(f"payload of {self._payload_len} bytes does not match its {total}-byte "
                                  "destination")
        self._sinks, self._sink_i, self._sink_pos = views, 0, 0
        self._state = _SUMS if self._flags & CHECKSUMS else _PAYLOAD

    def land_fresh(self, limit: int) -> memoryview:
        """The payload goes into a fresh buffer (returned), charged to the receive budget until the frame is
        complete; ``ResourceExhausted`` beyond ``limit`` bytes or beyond the budget."""
        assert self._state == _LANDING
        if self._payload_len > limit:
            raise ResourceExhausted(f"payload of {self._payload_len} bytes exceeds the limit of {limit} bytes")
        self._hold(self._payload_len)
        buf = memoryview(bytearray(self._payload_len))
        self.land([buf])
        return buf

    def skip(self) -> None:
        """Consume the payload (and its checksums) without keeping it."""
        assert self._state == _LANDING
        sums = 8 * chunk_count(self._payload_len) if self._flags & CHECKSUMS else 0
        self._discard_left = self._payload_len + sums
        self._state = _PAYLOAD

    # ------------------------------------------------------------------ internals

    def _body(self, body: bytes) -> Body:
        self._state = _LANDING if self._payload_len else _HEADER
        return Body(body, self._payload_len, bool(self._flags & CHECKSUMS))

    def _sums(self, raw: bytes) -> Checksums:
        self._state = _PAYLOAD
        return Checksums(unpack_checksums(raw))

    def _take_block(self, size: int) -> bool:
        """True when ``size`` bytes are staged; a block larger than the staging buffer is read directly
        into a buffer of its own (``_direct_filled`` picks it up), and False is returned."""
        avail = self._w - self._r
        if size <= len(self._staging):
            return avail >= size
        self._hold(size)
        self._big = bytearray(size)
        self._big[:avail] = self._staging[self._r : self._w]
        self._r = self._w
        self._start_direct(memoryview(self._big), avail)
        return False

    def _direct_filled(self) -> Event | None:
        """A direct target is full: a large block is complete, or a payload piece landed."""
        self._direct = None
        if self._state in (_BODY, _SUMS):
            block, self._big = bytes(self._big or b""), None
            self._release()
            return self._body(block) if self._state == _BODY else self._sums(block)
        if self._discard_left:
            self._discard_left -= self._direct_pos
        else:
            self._sink_i, self._sink_pos = self._sink_i + 1, 0
        return self._pump_payload()

    def _pump_payload(self) -> PayloadDone | None:
        if self._discard_left:
            avail = self._w - self._r
            take = min(avail, self._discard_left)
            self._r += take
            self._discard_left -= take
            if self._discard_left > 0:
                self._start_direct(memoryview(bytearray(min(_DISCARD, self._discard_left))), 0)
                return None
        while self._sink_i < len(self._sinks):
            view = self._sinks[self._sink_i]
            avail = self._w - self._r
            take = min(avail, len(view) - self._sink_pos)
            view[self._sink_pos : self._sink_pos + take] = self._staging[self._r : self._r + take]
            self._r += take
            self._sink_pos += take
            if self._sink_pos < len(view):
                self._start_direct(view, self._sink_pos)
                return None
            self._sink_i, self._sink_pos = self._sink_i + 1, 0
        self._sinks = []
        self._state = _HEADER
        self._release()  # the frame is complete: from here its buffer is the handler's (or the caller's)
        return _DONE

    def _start_direct(self, target: memoryview, pos: int) -> None:
        assert pos < len(target)
        self._direct, self._direct_pos = target, pos

    def _hold(self, nbytes: int) -> None:
        self._budget.take(nbytes)
        self._held += nbytes

    def _release(self) -> None:
        self._budget.give(self._held)
        self._held = 0
