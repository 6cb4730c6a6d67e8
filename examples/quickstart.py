"""Start a local TensorCast cluster, put a state dict, read it back (zero-copy on this host), and show
the cluster. Run: python examples/quickstart.py"""

from __future__ import annotations

import time

import numpy as np

import tensorcast as tc


def main() -> None:
    with tc.LocalCluster(workers=2, data_dir="./tc-data") as cluster:
        print(f"cluster up: gateway {cluster.address}, global store {cluster.gs_address}")
        with tc.connect(cluster.address) as client:
            rng = np.random.default_rng(0)
            state = {
                "layer0.weight": rng.standard_normal((1024, 1024), dtype=np.float32),
                "layer0.bias": np.zeros(1024, dtype=np.float32),
            }
            art = client.put(state, key="demo/model@v1")
            print(f"put {art.key} -> {art.id} ({art.nbytes / 2**20:.1f} MiB, replicas on "
                  f"{[r.worker_id for r in art.replicas]})")

            got = client.artifact("demo/model@v1").tensor_dict(like="numpy")
            for name, tensor in got.items():
                assert np.array_equal(tensor, state[name])
                print(f"get {name}: shape {tensor.shape} {tensor.dtype} byte-exact")

            again = client.put(state, key="demo/model@latest")
            print(f"same bytes again -> same id: {again.id == art.id}; keys {client.artifact(art.id).keys}")

            time.sleep(1.5)  # worker signals reach the global store with heartbeats (1 s)
            for w in client.list_workers():
                print(f"worker {w.worker_id} at {w.address}: {w.memory_used / 2**20:.1f} MiB used, "
                      f"{w.artifacts} artifacts, alive={w.alive}")
            client.delete(art.id)
    print("cluster stopped")


if __name__ == "__main__":
    main()
