"""Every RPC payload (remote put bytes, KV pages both ways) travels with per-chunk xxh3 checksums: a corrupted
chunk is detected by the receiver, nothing of it is used, and the sender's retry delivers the right bytes.
Real processes; the corruption is injected on the sending side (``wire.fault_corrupt_payload_chunks``)."""

from __future__ import annotations

import numpy as np
import pytest

import tensorcast as tc
from tensorcast.checksums import ChunkCorrupted
from tensorcast.client.puts import PUT_DATA_ATTEMPTS
from tensorcast.errors import NotFound
from tensorcast.kv import KVLayout, page_keys
from tensorcast.testing import RawPeer, running_cluster, wait_shards_settled
from tensorcast.wire.messages import ErrorReply, PutBegin, PutData, PutPlan
from tensorcast.wire.protocol import ERROR

MiB = 1 << 20
LAYOUT = KVLayout("ck-model", layers=2, kv_heads=2, head_dim=64, dtype="float16", page_size=16)


def _far(**flat: object) -> tc.Config:
    """A client on another host (every byte takes the socket path), with extra settings."""
    return tc.Config.from_flat({"client.host_id": "far-away", **flat})


def test_remote_put_chunks_are_checked_and_resent() -> None:
    data = np.random.default_rng(3).integers(0, 255, 9 * MiB, dtype=np.uint8)
    with running_cluster(workers=1) as cluster:
        with tc.connect(cluster.address, config=_far(**{"wire.fault_corrupt_payload_chunks": 1})) as c:
            art = c.put(data, key="ck/put")
            assert np.array_equal(c.artifact("ck/put").tensor(like="numpy"), data)
        # A link that corrupts every send: the put fails with a retryable error and stores nothing.
        flaky = _far(**{"wire.fault_corrupt_payload_chunks": PUT_DATA_ATTEMPTS})
        with tc.connect(cluster.address, config=flaky) as c:
            with pytest.raises(ChunkCorrupted) as info:
                c.put(data[::-1].copy(), key="ck/bad")
            assert info.value.retryable
            with pytest.raises(NotFound):
                c.artifact("ck/bad")
            assert c.artifact(art.id).nbytes == data.nbytes  # the worker serves on


def test_kv_pages_are_checked_both_ways() -> None:
    keys = page_keys(list(range(LAYOUT.page_size * 12)), LAYOUT)
    pages = [np.random.default_rng(i).integers(0, 255, LAYOUT.page_bytes, dtype=np.uint8) for i in range(len(keys))]
    # Every worker corrupts one chunk of each of its next 3 replies with pages; the client its next 2 puts.
    with running_cluster(workers=2, config={"wire.fault_corrupt_payload_chunks": 3, "kv.lease_ttl": 3.0}) as cluster, \
            tc.connect(cluster.address, config=_far(**{"wire.fault_corrupt_payload_chunks": 2})) as c:
        wait_shards_settled(c, set(cluster.worker_ids))  # pages put while shards move to their homes are misses
        assert c.kv.put(keys, pages) == len(keys)
        refreshed = c.aio.kv.table_refreshes
        for _ in range(3):
            got = c.kv.get(keys)
            assert all(g is not None and np.array_equal(g, p) for g, p in zip(got, pages, strict=True))
            bufs = [np.zeros(LAYOUT.page_bytes, np.uint8) for _ in keys]
            assert all(c.kv.get_into(keys, bufs))
            assert all(np.array_equal(b, p) for b, p in zip(bufs, pages, strict=True))
        assert c.aio.kv.table_refreshes > refreshed  # corrupted replies were refused and the reads retried


def test_a_payload_without_checksums_is_refused() -> None:
    with running_cluster(workers=1) as cluster:
        peer = RawPeer(cluster.address)
        try:
            peer.hello()
            meta = tc.TensorMeta(name="x", dtype="uint8", shape=(8,), nbytes=8, digest="0" * 64)
            peer.send(PutBegin(tensors=(meta,)), request_id=2)
            _env, plan = peer.recv()
            assert isinstance(plan, PutPlan)
            peer.send(PutData(put_id=plan.put_id, index=0, offset=0), request_id=3, payload=b"\0" * 8,
                      checksums=False)
            env, msg = peer.recv()
            assert env.kind == ERROR and isinstance(msg, ErrorReply) and msg.code == "INVALID_ARGUMENT"
            assert "checksums" in msg.message
            # The request failed, not the connection: the same peer is still served.
            peer.send(PutData(put_id=plan.put_id, index=0, offset=0), request_id=4, payload=b"\0" * 8)
            env, _ = peer.recv()
            assert env.kind != ERROR
        finally:
            peer.close()
