"""A worker's pull path (``worker.fetch.Fetcher``) over the in-process transport: two local stores in this
process, no sockets and no worker processes. Whole artifacts, rank views, corrupted chunks retried, a dead
source skipped for the next replica, and nothing partial kept when every source fails. Also a store serving
over TCP in process: chunk checksums learned while sending, and a slice's lease held until it is sent."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from tensorcast.checksums import CHUNK_BYTES, chunk_checksums
from tensorcast.config import Config, TransportConfig
from tensorcast.errors import NotFound, Unavailable
from tensorcast.pool.placement import PRESETS
from tensorcast.records import ArtifactInfo, ReplicaInfo, SliceSpec, TensorMeta
from tensorcast.tensors import artifact_id, normalize_tensors
from tensorcast.transport.base import DataServer
from tensorcast.transport.registry import make_transport
from tensorcast.wire.messages import DataRequest
from tensorcast.worker.fetch import Fetcher
from tensorcast.worker.store import LocalStore
from tensorcast.worker.trust import BlobTrust

MiB = 1 << 20


async def _gone(artifact_id: str, tier: str) -> None:
    return None


def _store(name: str) -> LocalStore:
    cfg = Config.from_flat({"worker.memory_capacity": 256 * MiB, "worker.prefault_bytes": 0,
                            "worker.shm_prefix": f"tc-test-{uuid.uuid4().hex[:8]}"})
    return LocalStore(cfg.worker, name, _gone)


def _hold(store: LocalStore, tensors: dict[str, np.ndarray]) -> ArtifactInfo:
    """Put ``tensors`` into ``store``'s memory tier as a worker's put would."""
    inputs = normalize_tensors(tensors)
    metas = tuple(t.meta for t in inputs)
    for item in inputs:
        if item.meta.nbytes and not store.memory.has_blob(item.meta.digest):
            loc = store.memory.allocate(item.meta.nbytes)
            loc.view()[:] = memoryview(item.data)  # type: ignore[arg-type]
            store.memory.commit_blob(item.meta.digest, loc)
    aid = artifact_id(metas)
    store.add_memory_replica(aid, metas, PRESETS["cache"])
    return ArtifactInfo(id=aid, tensors=metas, nbytes=sum(t.nbytes for t in metas))


class Pair:
    """A source store serving its bytes in process, and a destination store with its fetcher."""

    def __init__(self, corrupt_chunks: int = 0) -> None:
        self.transport = make_transport("inproc", Config().wire, token=None, max_streams=4)
        self.src = _store("src")
        self.server: DataServer = self.transport.serve(self.src.open_source, corrupt_chunks=corrupt_chunks)
        self.server.start("", 0)
        self.dst = _store("dst")
        self.fetcher = Fetcher("dst", self.dst, BlobTrust(self.dst), self.transport, TransportConfig(retries=2))

    def replica(self, worker_id: str = "src", address: str | None = None) -> ReplicaInfo:
        return ReplicaInfo(worker_id=worker_id, data_address=address or self.server.address)

    def close(self) -> None:
        self.server.close()
        self.src.close()
        self.dst.close()


@pytest.fixture()
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def _bytes(store: LocalStore, meta: TensorMeta) -> bytes:
    view, _tier, release = store.lease_blob(meta, "memory")
    try:
        return bytes(view)
    finally:
        release()


def test_a_whole_artifact_is_pulled_byte_exact(pair: Pair) -> None:
    rng = np.random.default_rng(0)
    tensors = {"big": rng.integers(0, 255, 9 * MiB + 3, dtype=np.uint8), "small": np.arange(100, dtype=np.int64)}
    info = _hold(pair.src, tensors)
    info = ArtifactInfo(id=info.id, tensors=info.tensors, nbytes=info.nbytes, replicas=(pair.replica(),))
    done = asyncio.run(pair.fetcher.fetch(info, time.time() + 30, "t", streams=2))
    assert not done.already_present and done.source == "src" and done.bytes_moved == info.nbytes
    for t in info.tensors:
        assert _bytes(pair.dst, t) == _bytes(pair.src, t)
    assert asyncio.run(pair.fetcher.fetch(info, None, "t")).already_present
    assert pair.fetcher.in_flight == 0


def test_a_rank_view_moves_only_its_slice(pair: Pair) -> None:
    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    info = _hold(pair.src, {"w": w})
    info = ArtifactInfo(id=info.id, tensors=info.tensors, nbytes=info.nbytes, replicas=(pair.replica(),))
    view = {"w": (SliceSpec(dim=1, start=8, stop=16),)}
    view_id = "tc-" + "f" * 32
    sent = pair.server.bytes_sent
    done, metas = asyncio.run(pair.fetcher.materialize_view(info, view, view_id, None, "t"))
    assert metas[0].shape == (64, 8) and done.bytes_moved == 64 * 8 * 4
    assert pair.server.bytes_sent - sent == 64 * 8 * 4  # the holder cut the slice: only it crossed
    got = np.frombuffer(_bytes(pair.dst, metas[0]), np.float32).reshape(64, 8)
    assert np.array_equal(got, w[:, 8:16])


def test_a_row_slice_stays_leased_until_sent(pair: Pair) -> None:
    """Contiguous rows are served straight from the pool's pages: dropping the artifact meanwhile must not
    let new bytes take those pages before the sender is done (a small blob's arena slot is reused first)."""
    w = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    info = _hold(pair.src, {"w": w})
    half = 8
    lease = pair.src.open_source(DataRequest(artifact_id=info.id, name="w", slices=(SliceSpec(dim=0, start=0,
                                                                                               stop=half),)))
    assert pair.src.drop(info.id)
    pair.src.memory.release_unreferenced()
    for _ in range(4):  # new bytes of the same size, where the freed pages would go first
        loc = pair.src.memory.allocate(w.nbytes)
        loc.view()[:] = b"\xff" * w.nbytes
    assert np.array_equal(np.frombuffer(lease.view, np.float32).reshape(half, 8), w[:half])
    lease.release()


def _eventually(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.mark.parametrize("streams", [1, 3])
def test_a_fresh_blobs_chunk_checksums_are_learned_as_it_is_sent(streams: int) -> None:
    """Over TCP: a blob nobody hashed yet is hashed chunk by chunk as it is sent (not in a pass before its
    first byte), and the checksums come back to the store, whole once the ranges cover the blob."""
    src = _store("src")
    transport = make_transport("tcp", Config().wire, token=None, max_streams=4)
    server = transport.serve(src.open_source)
    server.start("127.0.0.1", 0)
    try:
        data = np.random.default_rng(3).integers(0, 255, 3 * CHUNK_BYTES + 999, dtype=np.uint8)
        info = _hold(src, {"x": data})
        digest = info.tensors[0].digest
        assert src.checksums_of(digest) is None
        out = np.zeros_like(data)
        transport.fetch(server.address, DataRequest(artifact_id=info.id, name="x"), memoryview(out), streams=streams)
        assert np.array_equal(out, data)
        # The sender hands them back after its last chunk left: the receiver may be done a moment earlier.
        _eventually(lambda: src.checksums_of(digest) is not None, "the learned checksums")
        assert src.checksums_of(digest) == chunk_checksums(memoryview(data))
        again = np.zeros_like(data)  # served from the learned checksums now: the receiver still checks each chunk
        transport.fetch(server.address, DataRequest(artifact_id=info.id, name="x"), memoryview(again), streams=2)
        assert np.array_equal(again, data)
    finally:
        server.close()
        transport.close()
        src.close()


def test_parts_of_a_blob_teach_their_chunks_until_the_whole_list_is_known() -> None:
    src = _store("src")
    transport = make_transport("tcp", Config().wire, token=None, max_streams=4)
    server = transport.serve(src.open_source)
    server.start("127.0.0.1", 0)
    try:
        data = np.random.default_rng(4).integers(0, 255, 3 * CHUNK_BYTES, dtype=np.uint8)
        info = _hold(src, {"x": data})
        digest = info.tensors[0].digest
        sent = server.bytes_sent
        for n, first in enumerate((1, 0, 2)):  # one chunk at a time, out of order
            part = np.zeros(CHUNK_BYTES, np.uint8)
            req = DataRequest(artifact_id=info.id, name="x", offset=first * CHUNK_BYTES, length=CHUNK_BYTES)
            transport.fetch(server.address, req, memoryview(part))
            assert np.array_equal(part, data[first * CHUNK_BYTES : (first + 1) * CHUNK_BYTES])
            _eventually(lambda n=n: server.bytes_sent - sent >= (n + 1) * CHUNK_BYTES and not server.active,
                        "the sender to finish")
            if n < 2:
                assert src.checksums_of(digest) is None  # some chunks known: not a whole list yet
        assert src.checksums_of(digest) == chunk_checksums(memoryview(data))
    finally:
        server.close()
        transport.close()
        src.close()


def test_the_checksum_cache_keeps_the_newest_blobs(monkeypatch: pytest.MonkeyPatch) -> None:
    import tensorcast.worker.store as store_module

    monkeypatch.setattr(store_module, "_MAX_CHECKSUMS", 2)
    store = _store("src")
    try:
        for digest in ("a", "b", "c"):
            store.remember_checksums(digest, [1, 2])
        store.remember_checksums("b", [3])  # used again: now the newest
        store.remember_checksums("d", [4])
        assert [store.checksums_of(d) for d in "abcd"] == [None, [3], None, [4]]
    finally:
        store.close()


def test_corrupted_chunks_are_fetched_again() -> None:
    p = Pair(corrupt_chunks=2)
    try:
        data = np.random.default_rng(1).integers(0, 255, 6 * MiB, dtype=np.uint8)
        info = _hold(p.src, {"x": data})
        info = ArtifactInfo(id=info.id, tensors=info.tensors, nbytes=info.nbytes, replicas=(p.replica(),))
        done = asyncio.run(p.fetcher.fetch(info, None, "t"))
        assert done.retries == 2
        assert _bytes(p.dst, info.tensors[0]) == data.tobytes()
    finally:
        p.close()


def test_a_dead_source_makes_way_for_the_next_replica_and_nothing_partial_stays(pair: Pair) -> None:
    data = np.random.default_rng(2).integers(0, 255, 5 * MiB, dtype=np.uint8)
    info = _hold(pair.src, {"x": data})
    dead = pair.replica("gone", address="inproc:999999")
    good = ArtifactInfo(id=info.id, tensors=info.tensors, nbytes=info.nbytes, replicas=(dead, pair.replica()))
    done = asyncio.run(pair.fetcher.fetch(good, None, "t"))
    assert done.source == "src" and done.retries == 1
    pair.dst.drop(info.id)
    used = pair.dst.memory.state.used
    lost = ArtifactInfo(id=info.id, tensors=info.tensors, nbytes=info.nbytes, replicas=(dead,))
    with pytest.raises(Unavailable):
        asyncio.run(pair.fetcher.fetch(lost, None, "t"))
    assert pair.dst.memory.state.used == used and pair.dst.memory.state.reserved == 0
    assert not pair.dst.memory.has_replica(info.id)
    with pytest.raises(NotFound):
        asyncio.run(pair.fetcher.fetch(ArtifactInfo(id=info.id, tensors=info.tensors, nbytes=info.nbytes), None, "t"))
