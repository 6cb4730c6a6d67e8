"""The transport contract, run against every implementation (TCP streams and in-process): byte-exact ranges
and streams, verified chunk checksums, corrupted chunks detected, typed errors."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import xxhash

from tensorcast.checksums import CHUNK_BYTES, ChunkCorrupted, chunk_checksums
from tensorcast.config import WireConfig
from tensorcast.errors import DeadlineExceeded, InvalidArgument, NotFound, Unauthenticated, Unavailable
from tensorcast.records import SliceSpec
from tensorcast.transport import DataServer, SourceLease, Transport, make_transport
from tensorcast.transport.registry import TRANSPORTS
from tensorcast.transport.tcp_frames import CHECKSUM, recv_frame, send_frame
from tensorcast.wire.messages import DataReply, DataRequest
from tensorcast.wire.protocol import RESPONSE

DATA = np.random.default_rng(0).integers(0, 255, 3 * CHUNK_BYTES + 12345, dtype=np.uint8)
MATRIX = np.arange(64 * 48, dtype=np.uint32).reshape(64, 48)


def open_source(req: DataRequest) -> SourceLease:
    if req.name == "m":  # a 2-D tensor: slices are cut by the sender
        part = np.ascontiguousarray(MATRIX[:, 8:24] if req.slices else MATRIX)
        return SourceLease(part.reshape(-1).view(np.uint8).data, "memory", lambda: None)
    if req.name != "x":
        raise NotFound(f"no tensor {req.name}")
    return SourceLease(memoryview(DATA), "memory", lambda: None, chunk_checksums(memoryview(DATA)))


@pytest.fixture(params=sorted(TRANSPORTS))
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Transport, DataServer]]:
    transport = make_transport(request.param, WireConfig(), token="tok", max_streams=8)
    server = transport.serve(open_source)
    server.start("127.0.0.1", 0)
    yield transport, server
    server.close()
    transport.close()


@pytest.mark.parametrize("streams", [1, 2, 4])
def test_ranges_and_streams_are_byte_exact(pair: tuple[Transport, DataServer], streams: int) -> None:
    tr, server = pair
    out = np.zeros_like(DATA)
    sums: list[int] = []
    stats = tr.fetch(server.address, DataRequest(artifact_id="a", name="x"), memoryview(out), streams=streams,
                     checksums=sums)
    assert np.array_equal(out, DATA) and stats.bytes == DATA.nbytes
    assert 1 <= stats.streams <= streams and (streams == 1 or stats.streams > 1)
    assert sums == chunk_checksums(memoryview(DATA))
    part = np.zeros(1000, np.uint8)
    tr.fetch(server.address, DataRequest(artifact_id="a", name="x", offset=CHUNK_BYTES + 7), memoryview(part))
    assert np.array_equal(part, DATA[CHUNK_BYTES + 7 : CHUNK_BYTES + 1007])
    # The sender counts a chunk after handing it to the socket: the receiver may be done a moment earlier.
    deadline = time.monotonic() + 2.0
    while (server.bytes_sent < DATA.nbytes + part.nbytes or server.active) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.bytes_sent >= DATA.nbytes + part.nbytes and server.active == 0


def test_slices_are_cut_by_the_sender(pair: tuple[Transport, DataServer]) -> None:
    tr, server = pair
    want = np.ascontiguousarray(MATRIX[:, 8:24])
    out = np.zeros_like(want)
    req = DataRequest(artifact_id="a", name="m", slices=(SliceSpec(dim=1, start=8, stop=24),))
    stats = tr.fetch(server.address, req, memoryview(out.reshape(-1).view(np.uint8)), streams=4)
    assert np.array_equal(out, want) and stats.streams == 1


def test_corrupted_chunk_is_detected_and_nothing_is_trusted(pair: tuple[Transport, DataServer]) -> None:
    tr, _ = pair
    faulty = tr.serve(open_source, corrupt_chunks=1)
    faulty.start("127.0.0.1", 0)
    try:
        out = np.zeros_like(DATA)
        with pytest.raises(ChunkCorrupted) as info:
            tr.fetch(faulty.address, DataRequest(artifact_id="a", name="x"), memoryview(out))
        assert info.value.retryable
        tr.fetch(faulty.address, DataRequest(artifact_id="a", name="x"), memoryview(out))  # clean again
        assert np.array_equal(out, DATA)
    finally:
        faulty.close()


def test_errors_are_typed(pair: tuple[Transport, DataServer]) -> None:
    tr, server = pair
    with pytest.raises(NotFound):
        tr.fetch(server.address, DataRequest(artifact_id="a", name="y"), memoryview(bytearray(10)))
    with pytest.raises(InvalidArgument):
        tr.fetch(server.address, DataRequest(artifact_id="a", name="x", offset=DATA.nbytes - 5),
                 memoryview(bytearray(10)))
    server.close()
    with pytest.raises(Unavailable):
        tr.fetch(server.address, DataRequest(artifact_id="a", name="x"), memoryview(bytearray(10)))


def test_tcp_refuses_a_wrong_token() -> None:
    good = make_transport("tcp", WireConfig(), token="tok", max_streams=2)
    server = good.serve(open_source)
    server.start("127.0.0.1", 0)
    bad = make_transport("tcp", WireConfig(), token="wrong", max_streams=2)
    try:
        with pytest.raises(Unauthenticated):
            bad.fetch(server.address, DataRequest(artifact_id="a", name="x"), memoryview(bytearray(10)))
    finally:
        bad.close()
        server.close()
        good.close()


def test_tcp_fetch_ends_by_its_deadline_however_slowly_bytes_trickle() -> None:
    """A sender that keeps the connection busy with a byte now and then (as a lossy link in TCP backoff does)
    does not hold a fetch past its deadline: the deadline bounds the whole fetch, not each receive."""
    payload = bytes(range(60))
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def trickle() -> None:
        conn, _ = listener.accept()
        with conn:
            recv_frame(conn, 1 << 16)  # DataHello
            send_frame(conn, RESPONSE, DataReply(total=0, chunk_bytes=0))
            recv_frame(conn, 1 << 16)  # DataRequest
            send_frame(conn, RESPONSE, DataReply(total=len(payload), chunk_bytes=len(payload), tier="memory"))
            conn.sendall(CHECKSUM.pack(xxhash.xxh3_64_intdigest(payload)))
            for b in payload:  # 3 s in all, each byte well within the time left
                if stop.wait(0.05):
                    return
                conn.sendall(bytes([b]))

    sender = threading.Thread(target=trickle, daemon=True)
    sender.start()
    tr = make_transport("tcp", WireConfig(), token=None, max_streams=1)  # the fake server asks for no credential
    host, port = listener.getsockname()[:2]
    try:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            tr.fetch(f"{host}:{port}", DataRequest(artifact_id="a", name="x"), memoryview(bytearray(len(payload))),
                     deadline=time.time() + 0.6)
        assert time.monotonic() - t0 < 1.5
    finally:
        stop.set()
        tr.close()
        sender.join(timeout=5)
        listener.close()


def _cutting_server(cut: int, payload: bytes) -> tuple[socket.socket, threading.Thread]:
    """A data server (no credential) that closes its first ``cut`` connections at once, before their hello
    (as a server flooded with silent sockets closes the oldest unauthenticated ones), and serves the next."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        for _ in range(cut):
            conn, _ = listener.accept()
            conn.close()
        conn, _ = listener.accept()
        with conn, contextlib.suppress(Unavailable):  # the give-up test's last connection says nothing
            recv_frame(conn, 1 << 16)  # DataHello
            send_frame(conn, RESPONSE, DataReply(total=0, chunk_bytes=0))
            recv_frame(conn, 1 << 16)  # DataRequest
            send_frame(conn, RESPONSE, DataReply(total=len(payload), chunk_bytes=len(payload), tier="memory"))
            conn.sendall(CHECKSUM.pack(xxhash.xxh3_64_intdigest(payload)) + payload)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


@pytest.mark.parametrize("cut", [1, 2])
def test_tcp_connects_again_when_the_server_closes_it_before_the_handshake(cut: int) -> None:
    payload = bytes(range(200))
    listener, server = _cutting_server(cut, payload)
    tr = make_transport("tcp", WireConfig(), token=None, max_streams=1)
    host, port = listener.getsockname()[:2]
    try:
        dest = bytearray(len(payload))
        tr.fetch(f"{host}:{port}", DataRequest(artifact_id="a", name="x"), memoryview(dest), deadline=time.time() + 10)
        assert bytes(dest) == payload
    finally:
        tr.close()
        server.join(timeout=5)
        listener.close()


def test_tcp_gives_up_on_a_server_that_closes_every_connection_before_the_handshake() -> None:
    listener, server = _cutting_server(3, b"x")
    tr = make_transport("tcp", WireConfig(), token=None, max_streams=1)
    host, port = listener.getsockname()[:2]
    try:
        with pytest.raises(Unavailable, match="handshake"):
            tr.fetch(f"{host}:{port}", DataRequest(artifact_id="a", name="x"), memoryview(bytearray(1)),
                     deadline=time.time() + 10)
    finally:
        with socket.create_connection((host, port)):  # let the fake server's last accept return
            pass
        tr.close()
        server.join(timeout=5)
        listener.close()


def test_unknown_transport_is_refused() -> None:
    with pytest.raises(InvalidArgument, match=r"transport\.kind"):
        make_transport("carrier-pigeon", WireConfig(), token=None, max_streams=1)
