"""Calls that go to "the gateway" continue through another one when it is killed (kill -9, real processes):
registering a checkpoint (``from_disk``) as well as a put. Every byte read back is checked."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

import tensorcast as tc
from tensorcast.testing import running_cluster


def test_from_disk_continues_through_another_gateway_after_kill_9(tmp_path: Path) -> None:
    weights = {"w": np.arange(64, dtype=np.float32).reshape(8, 8), "b": np.arange(8, dtype=np.int64)}
    path = tmp_path / "model.safetensors"
    save_file(weights, str(path))
    with running_cluster(workers=2) as cluster, tc.connect(cluster.address) as client:
        first, other = cluster.workers["w0"].address, cluster.workers["w1"].address
        assert client.aio.caller.address == first
        cluster.kill_worker("w0")  # SIGKILL the gateway the client connected to

        art = client.from_disk(path, key="ckpt/failover", timeout=30)

        assert client.aio.caller.address == other, "from_disk did not move on to the live gateway"
        assert [r.worker_id for r in art.replicas] == ["w1"]
        got = art.tensor_dict(like="numpy")
        assert set(got) == set(weights)
        for name, want in weights.items():
            np.testing.assert_array_equal(got[name], want)
        # The key resolves through the gateway now in use too.
        np.testing.assert_array_equal(client.artifact("ckpt/failover").tensor("b", like="numpy"), weights["b"])
