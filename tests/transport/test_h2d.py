"""The pipelined host-to-device copy, run on CPU destinations (the same pipeline a GPU uses; the device
side is ``CopyEngine``). The CUDA engine itself is exercised by ``benchmarks/gpu_check.sh`` on a GPU host."""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest
import torch

from tensorcast.cuda import cuda_available
from tensorcast.errors import InvalidArgument
from tensorcast.transport.h2d import Chunk, HostCopyEngine, plan_chunks, to_device


def test_plan_cuts_every_tensor_and_rotates_buffers() -> None:
    plan = plan_chunks([10, 0, 25], chunk=8, buffers=3)
    assert plan == [Chunk(0, 0, 8, 0), Chunk(0, 8, 2, 1), Chunk(2, 0, 8, 2), Chunk(2, 8, 8, 0),
                    Chunk(2, 16, 8, 1), Chunk(2, 24, 1, 2)]
    with pytest.raises(InvalidArgument):
        plan_chunks([1], chunk=0, buffers=1)


@pytest.mark.parametrize("buffers", [1, 2, 3])
def test_pipeline_copies_exactly(buffers: int) -> None:
    g = torch.Generator().manual_seed(buffers)
    host = {
        "w": torch.rand(300, 77, generator=g).to(torch.bfloat16),
        "b": torch.rand(1001, generator=g, dtype=torch.float32),
        "empty": torch.empty(0, 5, dtype=torch.float16),
        "i": torch.arange(12345, dtype=torch.int64).reshape(5, -1)[:, ::3],  # not contiguous
    }
    out = to_device(host, "cpu", engine=HostCopyEngine(), chunk=4096, buffers=buffers)
    for name, t in host.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name], t)
        assert out[name].data_ptr() != t.data_ptr() or t.numel() == 0


def test_numpy_sources_and_destinations() -> None:
    host = {"x": np.arange(10_000, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(100, 100)}
    out = to_device(host, "cpu", engine=HostCopyEngine(like="numpy"), chunk=1000, buffers=2)
    assert out["x"].dtype == host["x"].dtype and np.array_equal(out["x"], host["x"])


def test_a_failing_copy_stops_the_pipeline_and_raises() -> None:
    class Failing(HostCopyEngine):
        calls = 0
        lock = threading.Lock()

        def copy(self, buffer: int, nbytes: int, dest: object, dest_offset: int) -> None:
            with self.lock:
                self.calls += 1
                if self.calls == 3:
                    raise RuntimeError("DMA error")
            super().copy(buffer, nbytes, dest, dest_offset)

    engine = Failing()
    with pytest.raises(RuntimeError, match="DMA error"):
        to_device({"w": torch.zeros(100_000)}, "cpu", engine=engine, chunk=1024, buffers=2)
    assert engine.calls < 100_000 * 4 // 1024  # the other buffer stopped early


def test_cpu_is_a_no_op_and_unknown_devices_are_refused() -> None:
    t = torch.ones(3)
    assert to_device({"t": t}, "cpu")["t"] is t
    with pytest.raises(InvalidArgument, match="device must be"):
        to_device({"t": t}, "tpu:0")
    if not cuda_available():
        with pytest.raises(InvalidArgument, match="no CUDA device"):
            to_device({"t": t}, "cuda:0")
