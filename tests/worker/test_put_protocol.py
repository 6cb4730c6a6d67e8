"""The worker's put protocol spoken by hand: corrupted streams and stray puts are refused cleanly."""

from __future__ import annotations

import numpy as np

import tensorcast as tc
from tensorcast.cluster import LocalCluster
from tensorcast.records import TensorMeta
from tensorcast.tensors import digest_bytes
from tensorcast.testing import RawPeer
from tensorcast.wire.messages import PutBegin, PutCommit, PutData, PutPlan
from tensorcast.wire.protocol import ERROR


def test_corrupted_stream_is_detected_and_nothing_is_stored(shared_cluster: LocalCluster) -> None:
    good = np.arange(4096, dtype=np.uint8).tobytes()
    meta = TensorMeta(name="t", dtype="uint8", shape=(4096,), nbytes=4096, digest=digest_bytes(good))
    peer = RawPeer(shared_cluster.address)
    peer.hello()
    peer.send(PutBegin(tensors=(meta,), key="corrupt/t"), request_id=1)
    _, plan = peer.recv()
    assert isinstance(plan, PutPlan) and plan.stream
    bad = bytearray(good)
    bad[100] ^= 0xFF  # one flipped byte in transit
    peer.send(PutData(put_id=plan.put_id, index=0, offset=0), request_id=2, payload=bytes(bad))
    peer.recv()
    peer.send(PutCommit(put_id=plan.put_id), request_id=3)
    env, err = peer.recv()
    assert env.kind == ERROR and err.code == "INVALID_ARGUMENT" and "digest" in err.message
    peer.close()
    with tc.connect(shared_cluster.address) as c:
        assert not c.ls("corrupt/")


def test_payload_for_unknown_put_is_refused(shared_cluster: LocalCluster) -> None:
    peer = RawPeer(shared_cluster.address)
    peer.hello()
    peer.send(PutData(put_id="nope", index=0, offset=0), request_id=5, payload=b"x" * 1000)
    env, err = peer.recv()
    assert env.request_id == 5 and env.kind == ERROR and err.code == "NOT_FOUND"
    peer.send(PutCommit(put_id="nope"), request_id=6)
    env, err = peer.recv()
    assert env.request_id == 6 and err.code == "NOT_FOUND"
    peer.close()


def test_metadata_that_does_not_add_up_is_refused(shared_cluster: LocalCluster) -> None:
    peer = RawPeer(shared_cluster.address)
    peer.hello()
    wrong = TensorMeta(name="t", dtype="float32", shape=(10,), nbytes=39, digest="0" * 64)
    peer.send(PutBegin(tensors=(wrong,)), request_id=1)
    env, err = peer.recv()
    assert env.kind == ERROR and err.code == "INVALID_ARGUMENT" and "do not match" in err.message
    odd = TensorMeta(name="t", dtype="float13", shape=(1,), nbytes=2, digest="0" * 64)
    peer.send(PutBegin(tensors=(odd,)), request_id=2)
    env, err = peer.recv()
    assert err.code == "INVALID_ARGUMENT" and "dtype" in err.message
    peer.close()
