"""The cold path into pre-faulted pool memory (a pack carved out of stock chunks), and the GPU options on a
host without CUDA: refused with a clear error, nothing else disturbed. (On a CUDA host the same test checks
the CUDA IPC hand-off; ``benchmarks/gpu_check.sh`` times it.)"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import tensorcast as tc
from tensorcast.cuda import cuda_available
from tensorcast.errors import InvalidArgument
from tensorcast.testing import running_cluster
from tensorcast.wire.messages import Prefetched

MiB = 1 << 20


def _nice(pid: int, tid: str) -> int:
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


def test_cold_prefetch_fills_a_pack_from_the_stock_and_maps_it(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(5)
    tensors = {f"layers.{i}.w": torch.rand(512, 1024 + i, generator=g).to(torch.bfloat16) for i in range(12)}
    tensors["norm"] = torch.ones(64, dtype=torch.bfloat16)  # small: carved out of the pack too, so mapped
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = {"worker.prefault_bytes": 32 * MiB, "worker.prefault_chunk_bytes": 8 * MiB}
    with running_cluster(workers=1, config=config) as cluster, tc.connect(cluster.address) as client:
        end = time.monotonic() + 30
        while client.list_workers()[0].memory_prefaulted < 32 * MiB and time.monotonic() < end:
            time.sleep(0.2)
        assert client.list_workers()[0].memory_prefaulted == 32 * MiB  # the signal callers size bursts by
        # It was filled by a thread at the lowest priority (nice 19): it hardly competes with an engine starting
        # up, and (unlike SCHED_IDLE) it is never starved while it holds a lock the event loop needs.
        pid = client.list_workers()[0].pid
        assert 19 in {_nice(pid, tid) for tid in os.listdir(f"/proc/{pid}/task")}
        art = client.from_disk(tmp_path)
        done = art.prefetch(to="w0").result(timeout=60)
        assert not done.already_present and done.bytes_moved == art.nbytes
        got = art.tensor_dict()  # through the same handle: it sees the new memory replica
        d = art.last_diagnostics
        assert d is not None and d.tier == "memory" and d.transport == "shared-memory"
        assert d.bytes_moved == 0  # every tensor mapped, the small one included: nothing was copied
        for name, t in tensors.items():
            assert torch.equal(got[name], t), name
        client.delete(art.id)
        assert torch.equal(got["layers.3.w"], tensors["layers.3.w"])  # mappings outlive the delete

        # Every rank of an engine asks at once: one read, the others wait for it.
        art = client.from_disk(tmp_path)

        async def both() -> list[Prefetched]:
            return list(await asyncio.gather(*(client.aio.prefetch(art.id, "w0") for _ in range(3))))

        results = client._run(both())
        assert sorted(r.already_present for r in results) == [False, True, True]
        assert sum(r.bytes_moved for r in results) == art.nbytes
        assert torch.equal(art.tensor("layers.7.w"), tensors["layers.7.w"])


def test_gpu_options(client: tc.Client) -> None:
    art = client.put({"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64)})
    if not cuda_available():
        with pytest.raises(InvalidArgument, match="no CUDA device"):
            art.prefetch(to="w0", device="cuda:0").result(timeout=30)
        with pytest.raises(InvalidArgument, match="no such device"):
            art.tensor_dict(device="cuda:0")
        with pytest.raises(InvalidArgument, match="like='torch'"):
            art.tensor_dict(like="numpy", device="cuda:0")
        # Nothing else was disturbed: the same artifact is prefetched and read as usual.
        art.prefetch(to="w0").result(timeout=30)
        assert torch.equal(art.tensor("w"), torch.arange(4096, dtype=torch.float32).reshape(64, 64))
        return
    art.prefetch(to="w0", device="cuda:0").result(timeout=60)
    got = art.tensor_dict(device="cuda:0")
    assert art.last_diagnostics is not None and art.last_diagnostics.transport == "cuda-ipc"
    assert torch.equal(got["w"].cpu(), torch.arange(4096, dtype=torch.float32).reshape(64, 64))
