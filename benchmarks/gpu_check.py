"""GPU path check and timing (needs a CUDA host; prints why not and exits 2 elsewhere).

On a generated Llama-shaped bf16 checkpoint (2 GiB; 0.5 GiB with --quick) it checks every tensor that
reaches the GPU against ``safetensors`` and times, in one run:
- baselines: ``safetensors.torch.load_file(device="cuda:0")``, and ``load_file`` then ``.to("cuda")``
  per tensor (pageable memory, one stream);
- TensorCast cold to GPU: ``from_disk`` + ``tensor_dict(device="cuda:0")``: the checkpoint is mapped and
  fed through pinned staging buffers with one CUDA stream each (reads/page faults of the next chunks
  overlap the copy in flight), with 1 buffer (no overlap) and with 3;
- TensorCast warm GPU hand-off: ``prefetch(to=worker, device="cuda:0")`` (the worker copies its memory
  replica to its GPU), then ``tensor_dict(device="cuda:0")`` opens the worker's tensors with CUDA IPC:
  no copy, milliseconds;
- the same for one tensor-parallel rank (TP=2, rank 1) of the checkpoint.
Ratios are to ``load_file(device="cuda:0")``.

``--smoke`` (a 64 MiB checkpoint of a narrow model) still needs a CUDA device: there is no CPU path to smoke, and
``benchmarks/smoke.py`` skips this benchmark on a host without one.

Usage: python benchmarks/gpu_check.py [--quick | --smoke] [--json PATH]
"""

from __future__ import annotations

import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

import tensorcast as tc
from tensorcast.cuda import cuda_available
from tensorcast.transport import h2d

sys.path.insert(0, str(Path(__file__).parent))
from benchlib import Table, parse_args, parser, pick, write_json
from weights_load import LLAMA, LLAMA_SMOKE, make_checkpoint

GiB = 1 << 30


def timed(fn: Any) -> tuple[float, Any]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def check(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], label: str) -> None:
    assert set(got) == set(ref), label
    for name, t in ref.items():
        g = got[name]
        assert g.device.type == "cuda" and g.dtype == t.dtype and g.shape == t.shape, (label, name)
        assert torch.equal(g.cpu(), t), (label, name)


def main() -> None:
    args = parse_args(parser(__doc__, "a 0.5 GiB checkpoint"))
    if not cuda_available():
        print(f"no CUDA device here (torch {torch.__version__}, torch.cuda.is_available() is False): "
              "the GPU path cannot be checked on this host")
        sys.exit(2)
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tc-gpu-") as tmp:
        path = make_checkpoint(Path(tmp), pick(args, 2 * GiB, GiB // 2, 64 << 20),
                               pick(args, LLAMA, LLAMA, LLAMA_SMOKE))
        files = sorted(path.glob("*.safetensors"))
        ref: dict[str, torch.Tensor] = {}
        for f in files:
            ref.update({k: v.clone() for k, v in load_file(str(f)).items()})
        total = sum(t.nbytes for t in ref.values())
        print(f"checkpoint: {total / GiB:.2f} GiB, {len(ref)} tensors\n")
        res: dict[str, float] = {}
        res["safetensors load_file(device=cuda)"], out = timed(
            lambda: {k: v for f in files for k, v in load_file(str(f), device="cuda:0").items()})
        check(out, ref, "load_file cuda")
        del out
        res["safetensors load_file + .to(cuda)"], out = timed(
            lambda: {k: v.to("cuda:0") for f in files for k, v in load_file(str(f)).items()})
        del out
        config = {"worker.prefault_bytes": total + GiB // 2, "weights.allowed_roots": tmp}
        with tc.LocalCluster(workers=1, memory_capacity=f"{2 * total + GiB}", config=config) as cluster, \
                tc.connect(cluster.address) as client:
            art = client.from_disk(path, key="gpu/model")
            for buffers in (1, 3):
                host = art.tensor_dict()  # mapped checkpoint files: read as the pipeline touches them
                res[f"tensorcast cold -> cuda, {buffers} staging buffer(s)"], out = timed(
                    partial(h2d.to_device, host, "cuda:0", engine=h2d.CudaCopyEngine("cuda:0"), buffers=buffers))
                check(out, ref, f"cold {buffers}")
                del out, host
            res["tensorcast cold -> cuda (tensor_dict(device=))"], out = timed(
                lambda: art.tensor_dict(device="cuda:0"))
            check(out, ref, "cold tensor_dict")
            del out
            t0 = time.perf_counter()
            art.prefetch(to="w0", device="cuda:0").result(timeout=600)
            res["warm: prefetch(to=w0, device=cuda) (once, ahead of time)"] = time.perf_counter() - t0
            res["tensorcast warm hand-off (CUDA IPC)"], out = timed(lambda: art.tensor_dict(device="cuda:0"))
            assert art.last_diagnostics is not None and art.last_diagnostics.transport == "cuda-ipc", \
                art.last_diagnostics
            check(out, ref, "warm ipc")
            del out
            tp = tc.TP(1, 2)
            art.prefetch(to="w0", tp=tp, device="cuda:0").result(timeout=600)
            view = art.view(tp=tp)
            res["tensorcast warm hand-off, TP=2 rank 1 (CUDA IPC)"], out = timed(
                lambda: view.tensor_dict(device="cuda:0"))
            assert view.last_diagnostics is not None and view.last_diagnostics.transport == "cuda-ipc"
            cpu_view = view.tensor_dict()
            check(out, {k: v.clone() for k, v in cpu_view.items()}, "warm tp ipc")
            del out
    base = res["safetensors load_file(device=cuda)"]
    table = Table(("path", "<58"), ("seconds", ">9.4f"), ("GB/s", ">8.2f"), ("x load_file", ">12.3f"))
    table.header()
    for name, secs in res.items():
        table.row(name, secs, total / secs / 1e9, secs / base)
        rows.append({"path": name, "seconds": secs, "ratio_to_load_file_cuda": secs / base})
    print("\nall tensors on the GPU matched safetensors")
    write_json(args.json, "gpu_check", args.quick, device=torch.cuda.get_device_name(0), checkpoint_bytes=total,
               rows=rows)


if __name__ == "__main__":
    main()
