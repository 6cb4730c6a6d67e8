"""Worker-to-worker transfers with faults: corrupted chunks, a source killed mid-transfer, nearest replica."""

from __future__ import annotations

import threading
import time

import numpy as np

import tensorcast as tc
from tensorcast.errors import TensorCastError
from tensorcast.testing import running_cluster

MiB = 1 << 20


def test_corrupted_chunk_is_detected_and_retried() -> None:
    with running_cluster(workers=2, config={"worker.fault_corrupt_chunks": 1}) as cluster, \
            tc.connect(cluster.address) as c:
        data = np.random.default_rng(1).integers(0, 255, 10 * MiB, dtype=np.uint8)
        art = c.put(data)
        res = art.prefetch(to="w1").result(timeout=60)
        assert res.retries >= 1 and res.source == "w0"
        got = c.artifact(art.id).tensor(like="numpy", source="prefer_p2p")
        assert np.array_equal(got, data)
        # A reader on another host fetches over TCP; w1's first chunk is corrupted too, then retried.
        remote = tc.connect(cluster.address, config=tc.Config.from_flat({"client.host_id": "elsewhere"}))
        try:
            far = remote.artifact(art.id)
            assert np.array_equal(far.tensor(like="numpy"), data)
            assert far.last_diagnostics is not None and far.last_diagnostics.transport == "tcp"
        finally:
            remote.close()


def test_killed_source_mid_transfer_retries_another_replica_or_fails_cleanly() -> None:
    with running_cluster(workers=3, memory_capacity="2GiB",
                         config={"transport.streams": 1}) as cluster, tc.connect(cluster.address) as c:
        data = np.random.default_rng(2).integers(0, 255, 384 * MiB, dtype=np.uint8)
        lone_data = data[: 256 * MiB] ^ 0x5A
        lone = c.put(lone_data, on="w1")  # its only replica
        art = c.put(data, on="w0")
        art.prefetch(to="w1").result(timeout=120)
        # w2 pulls from w0 (memory, listed first); kill w0 while the bytes are moving.
        op = art.prefetch(to="w2")
        threading.Timer(0.05, cluster.kill_worker, args=("w0",)).start()
        try:
            res = op.result(timeout=120)
            ok = True
        except TensorCastError:
            ok = False
        survivor = tc.connect(cluster.workers["w2"].address)  # the gateway w0 is gone
        if ok:
            assert res.bytes_moved == data.nbytes
            got = survivor.artifact(art.id).tensor(like="numpy", source="prefer_p2p")
            assert np.array_equal(got, data), "a transfer retried after its source died returned wrong bytes"
        # The only replica's holder dies mid-transfer: a clean error, and nothing partial is kept.
        # Freeze the source a moment into the transfer, then kill it (so the kill lands mid-transfer).
        op = survivor.artifact(lone.id).prefetch(to="w2")
        time.sleep(0.02)
        cluster.pause_worker("w1")
        finished_first = op.done() and op.exception() is None
        cluster.kill_worker("w1")
        if finished_first:  # the transfer beat the pause: it must then be complete and exact
            got = survivor.artifact(lone.id).tensor(like="numpy", source="prefer_p2p")
            assert np.array_equal(got, lone_data)
        else:
            try:
                op.result(timeout=120)
                raise AssertionError("a transfer from a killed sole source cannot succeed")
            except TensorCastError as exc:
                assert exc.retryable or isinstance(exc, tc.errors.NotFound)
            assert ("w2", "memory") not in {(r.worker_id, r.tier) for r in survivor.artifact(lone.id).replicas}
        survivor.close()


def test_reads_come_from_the_nearest_replica_with_diagnostics() -> None:
    with running_cluster(workers=2, hosts=2) as cluster, tc.connect(cluster.address) as c:
        data = np.random.default_rng(3).integers(0, 255, 8 * MiB, dtype=np.uint8)
        art = c.put(data, on="w1")  # w1 is on the other "host"
        far = c.artifact(art.id)
        assert np.array_equal(far.tensor(like="numpy"), data)
        d = far.last_diagnostics
        assert d is not None and d.replica == "w1" and d.transport == "tcp" and d.bytes_moved == data.nbytes
        art.prefetch(to="w0").result(timeout=60)
        near = c.artifact(art.id)
        assert np.array_equal(near.tensor(like="numpy"), data)
        d = near.last_diagnostics
        assert d is not None and d.replica == "w0" and d.transport == "shared-memory" and d.bytes_moved == 0
        # Source preferences.
        near.tensor(like="numpy", source="local_only")
        c.put(np.arange(3), key="far-only", on="w1")
        try:
            c.artifact("far-only").tensor(like="numpy", source="local_only")
            raise AssertionError("local_only must not read from another host")
        except tc.errors.Unavailable:
            pass
