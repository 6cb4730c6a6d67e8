"""The sans-IO frame reader on byte strings: events, splits at every byte, header checks, payload destinations,
checksum blocks, large blocks and the receive budget."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest

from tensorcast.checksums import CHUNK_BYTES, chunk_checksums, pack_checksums
from tensorcast.errors import InvalidArgument, ResourceExhausted, Unauthenticated
from tensorcast.wire.frame_reader import Body, Checksums, Event, FrameReader, PayloadDone
from tensorcast.wire.frames import CHECKSUMS, pack_header
from tensorcast.wire.shared import ReceiveBudget

OnBody = Callable[[FrameReader, Body], None]


def frame(body: bytes, payload: bytes = b"", *, sums: bool = True) -> bytes:
    flags = CHECKSUMS if payload and sums else 0
    head = pack_header(len(body), len(payload), flags)
    block = pack_checksums(chunk_checksums(memoryview(payload))) if flags else b""
    return head + body + block + payload


class Receiver:
    """Lands each payload in a fresh destination of its own (what a request's sink chooser would do)."""

    def __init__(self) -> None:
        self.payloads: list[bytearray] = []

    def __call__(self, reader: FrameReader, body: Body) -> None:
        dest = bytearray(body.payload_len)
        self.payloads.append(dest)
        reader.land([memoryview(dest)])


def drive(reader: FrameReader, pieces: Iterable[bytes], on_body: OnBody) -> list[Event]:
    """What ``asyncio.BufferedProtocol`` does: each piece arrives in as many reads as the reader's buffers
    take, and the events are taken after every read."""
    events: list[Event] = []

    def drain() -> None:
        while (event := reader.next_event()) is not None:
            events.append(event)
            if isinstance(event, Body) and event.payload_len:
                on_body(reader, event)

    for piece in pieces:
        view = memoryview(piece)
        while view:
            buf = reader.get_buffer()
            n = min(len(buf), len(view))
            assert n > 0, "the reader offered no room"
            buf[:n] = view[:n]
            view = view[n:]
            reader.buffer_updated(n)
            drain()
    drain()
    return events


def reader(staging: int = 4096, max_body: int = 1 << 20, budget: ReceiveBudget | None = None) -> FrameReader:
    return FrameReader(staging, max_body, budget or ReceiveBudget(1 << 30))


def expected(*frames: tuple[bytes, bytes]) -> list[Event]:
    out: list[Event] = []
    for body, payload in frames:
        out.append(Body(body, len(payload), bool(payload)))
        if payload:
            out += [Checksums(chunk_checksums(memoryview(payload))), PayloadDone()]
    return out


FRAMES = [(b"hello", b""), (b"put", bytes(range(256)) * 5), (b"", b""), (b"x" * 100, b"\x07" * 3)]
STREAM = b"".join(frame(b, p) for b, p in FRAMES)


def test_whole_frames_in_one_read() -> None:
    recv = Receiver()
    assert drive(reader(), [STREAM], recv) == expected(*FRAMES)
    assert [bytes(p) for p in recv.payloads] == [p for _, p in FRAMES if p]


def test_frames_split_at_every_byte_boundary() -> None:
    for cut in range(len(STREAM) + 1):
        recv = Receiver()
        assert drive(reader(), [STREAM[:cut], STREAM[cut:]], recv) == expected(*FRAMES), cut
        assert [bytes(p) for p in recv.payloads] == [p for _, p in FRAMES if p]
    recv = Receiver()  # and one byte at a time, through a staging buffer barely larger than a header
    one_by_one = [STREAM[i : i + 1] for i in range(len(STREAM))]
    assert drive(reader(staging=128), one_by_one, recv) == expected(*FRAMES)
    assert [bytes(p) for p in recv.payloads] == [p for _, p in FRAMES if p]


def test_payload_bytes_go_straight_into_the_chosen_destination() -> None:
    payload = b"\xab" * 10_000
    raw = frame(b"req", payload)
    r = reader()
    dest = bytearray(len(payload))
    # Everything up to the payload: the header and body, then (once landed) the checksums from staging.
    events = drive(r, [raw[: len(raw) - len(payload)]], lambda rd, _body: rd.land([memoryview(dest)]))
    assert isinstance(events[-1], Checksums)
    buf = r.get_buffer()
    assert buf.obj is dest and len(buf) == len(payload)  # recv_into the destination itself, not staging
    buf[:] = payload
    r.buffer_updated(len(payload))
    assert r.next_event() == PayloadDone() and r.next_event() is None
    assert bytes(dest) == payload


def test_scattered_destination_is_filled_in_order() -> None:
    payload = bytes(range(200))
    parts = [bytearray(50), bytearray(0), bytearray(150)]
    events = drive(reader(), [frame(b"b", payload)], lambda rd, _b: rd.land([memoryview(p) for p in parts]))
    assert events[-1] == PayloadDone()
    assert b"".join(parts) == payload


def test_bad_magic_and_bad_version() -> None:
    with pytest.raises(InvalidArgument, match="magic"):
        drive(reader(), [b"GARBAGE!" * 4], Receiver())
    raw = frame(b"x")
    with pytest.raises(InvalidArgument, match="version"):
        drive(reader(), [raw[:2] + b"\x63" + raw[3:]], Receiver())


def test_oversized_body_is_refused_and_a_large_one_read_directly_within_the_budget() -> None:
    with pytest.raises(ResourceExhausted, match="frame body"):
        drive(reader(max_body=100), [frame(b"y" * 101)], Receiver())
    budget = ReceiveBudget(1 << 20)
    r = reader(staging=64, budget=budget)
    body = bytes(range(256)) * 4  # larger than the staging buffer: read into a block of its own
    head = frame(body)[:80]
    assert drive(r, [head], Receiver()) == []
    assert budget.held == len(body)  # the block is charged while it fills
    assert drive(r, [frame(body)[80:]], Receiver()) == [Body(body, 0, False)]
    assert budget.held == 0
    with pytest.raises(ResourceExhausted, match="receive buffers full"):
        drive(reader(staging=64, budget=ReceiveBudget(100)), [frame(body)], Receiver())


def test_oversized_payload_in_a_fresh_buffer_is_refused_and_skipped() -> None:
    budget = ReceiveBudget(1 << 20)
    r = reader(budget=budget)
    refused: list[Exception] = []
    fresh: list[memoryview] = []

    def land_fresh(rd: FrameReader, _body: Body) -> None:
        try:
            fresh.append(rd.land_fresh(limit=1000))
            assert budget.held == 1000
        except ResourceExhausted as exc:
            refused.append(exc)
            rd.skip()

    big = b"z" * (2 * 1024 * 1024 + 5)  # skipped in several discard reads, with its checksums
    events = drive(r, [frame(b"a", big), frame(b"b", b"k" * 1000), frame(b"c")], land_fresh)
    assert len(refused) == 1 and "exceeds the limit of 1000 bytes" in str(refused[0])
    assert [e for e in events if isinstance(e, Body)] == [Body(b"a", len(big), True), Body(b"b", 1000, True),
                                                          Body(b"c", 0, False)]
    assert sum(isinstance(e, Checksums) for e in events) == 1  # a skipped payload's checksums are not reported
    assert sum(isinstance(e, PayloadDone) for e in events) == 2
    assert bytes(fresh[0]) == b"k" * 1000 and budget.held == 0  # given back once the frame is complete


def test_payload_before_payloads_are_accepted() -> None:
    r = FrameReader(4096, 4096, ReceiveBudget(1 << 20), payloads=False)
    assert drive(r, [frame(b"hello")], Receiver()) == expected((b"hello", b""))
    with pytest.raises(Unauthenticated, match="payload before the handshake"):
        drive(r, [frame(b"put", b"x")], Receiver())


def test_checksum_flag() -> None:
    payload = b"p" * 300
    no_sums = frame(b"n", payload, sums=False)  # no checksum block: the payload follows the body
    recv = Receiver()
    assert drive(reader(), [no_sums], recv) == [Body(b"n", 300, False), PayloadDone()]
    assert bytes(recv.payloads[0]) == payload
    events = drive(reader(), [no_sums + frame(b"next")], lambda rd, _b: rd.skip())
    assert events[-1] == Body(b"next", 0, False)  # skipped without a checksum block to consume
    # A payload of several chunks has one checksum per chunk; with a tiny staging buffer the block of them is
    # read directly, like a large body.
    many = bytes(2 * CHUNK_BYTES + 1)
    recv = Receiver()
    events = drive(reader(staging=16), [frame(b"m", many)], recv)
    assert events[1] == Checksums(chunk_checksums(memoryview(many))) and len(events[1].sums) == 3
    assert events[-1] == PayloadDone() and recv.payloads[0] == many


def test_destination_of_the_wrong_size_is_refused() -> None:
    r = reader()
    with pytest.raises(InvalidArgument, match="does not match its 3-byte destination"):
        drive(r, [frame(b"b", b"four")], lambda rd, _b: rd.land([memoryview(bytearray(3))]))


def test_the_destination_must_be_chosen_before_the_next_event() -> None:
    with pytest.raises(RuntimeError, match="destination is not chosen"):
        drive(reader(), [frame(b"b", b"data")], lambda rd, _b: None)


def test_close_gives_back_the_budget_and_drains() -> None:
    budget = ReceiveBudget(1 << 20)
    r = reader(staging=64, budget=budget)
    drive(r, [frame(b"q" * 500)[:100]], Receiver())
    assert budget.held == 500
    r.close()
    assert budget.held == 0
    buf = r.get_buffer()
    buf[:4] = b"junk"
    r.buffer_updated(4)
    assert r.next_event() is None
