"""The data plane in-process: multi-stream transfers, checksums, auth, ranges."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from tensorcast.config import WireConfig
from tensorcast.errors import InvalidArgument, NotFound, Unauthenticated
from tensorcast.transport import ChunkCorrupted, DataServer, SourceLease, TcpTransport
from tensorcast.transport.base import CHUNK_BYTES, chunk_checksums
from tensorcast.wire.messages import DataRequest

DATA = np.random.default_rng(0).integers(0, 255, 3 * CHUNK_BYTES + 12345, dtype=np.uint8)


@pytest.fixture()
def server() -> Iterator[DataServer]:
    released: list[int] = []

    def open_source(req: DataRequest) -> SourceLease:
        if req.name != "x":
            raise NotFound(f"no tensor {req.name}")
        return SourceLease(memoryview(DATA), "memory", lambda: released.append(1), chunk_checksums(memoryview(DATA)))

    srv = DataServer(open_source, WireConfig(), token="tok")
    srv.start("127.0.0.1", 0)
    yield srv
    srv.close()


@pytest.mark.parametrize("streams", [1, 2, 4])
def test_ranges_and_streams_are_byte_exact(server: DataServer, streams: int) -> None:
    tr = TcpTransport(WireConfig(), token="tok")
    try:
        out = np.zeros_like(DATA)
        sums: list[int] = []
        stats = tr.fetch(server.address, DataRequest(artifact_id="a", name="x"), memoryview(out), streams=streams,
                         checksums=sums)
        assert np.array_equal(out, DATA) and stats.bytes == DATA.nbytes
        assert sums == chunk_checksums(memoryview(DATA))
        part = np.zeros(1000, np.uint8)
        tr.fetch(server.address, DataRequest(artifact_id="a", name="x", offset=CHUNK_BYTES + 7), memoryview(part))
        assert np.array_equal(part, DATA[CHUNK_BYTES + 7 : CHUNK_BYTES + 1007])
    finally:
        tr.close()


def test_corrupted_chunk_is_detected(server: DataServer) -> None:
    tr = TcpTransport(WireConfig(), token="tok")
    try:
        server._corrupt_left = 1
        out = np.zeros_like(DATA)
        with pytest.raises(ChunkCorrupted):
            tr.fetch(server.address, DataRequest(artifact_id="a", name="x"), memoryview(out))
        tr.fetch(server.address, DataRequest(artifact_id="a", name="x"), memoryview(out))  # clean again
        assert np.array_equal(out, DATA)
    finally:
        tr.close()


def test_errors_are_typed(server: DataServer) -> None:
    bad = TcpTransport(WireConfig(), token="wrong")
    with pytest.raises(Unauthenticated):
        bad.fetch(server.address, DataRequest(artifact_id="a", name="x"), memoryview(bytearray(10)))
    bad.close()
    tr = TcpTransport(WireConfig(), token="tok")
    with pytest.raises(NotFound):
        tr.fetch(server.address, DataRequest(artifact_id="a", name="y"), memoryview(bytearray(10)))
    with pytest.raises(InvalidArgument):
        tr.fetch(server.address, DataRequest(artifact_id="a", name="x", offset=DATA.nbytes - 5),
                 memoryview(bytearray(10)))
    tr.close()
