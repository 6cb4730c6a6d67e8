"""vLLM's OffloadingConnector with the TensorCast tier, end to end on a GPU (needs CUDA and vLLM's CUDA build;
prints why not and exits 2 elsewhere: vLLM's CPU build refuses the OffloadingConnector's worker).

One run, a generated Llama-shaped fp16 model, prompts of each length:
- recompute: an engine without a connector computes every prompt (its TTFT, its tokens);
- engine A (``OffloadingConnector`` + ``TieringOffloadingSpec`` + ``TensorCastTier``) computes them; vLLM
  offloads their blocks to its CPU tier and the tier cascades them into the pool;
- engine B, started fresh (empty GPU and CPU caches), gets the same prompts: the tier finds A's units,
  promotes them into B's CPU tier, vLLM loads them to the GPU. Checked: B's tokens equal recompute's, and B
  reports the prompt's blocks cached. Reported: TTFT, and its reduction against recompute.
Engines run one after another (each takes most of the GPU's memory).

Usage: python benchmarks/vllm_tier_check.py [--quick | --smoke] [--json PATH]
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import tensorcast as tc
from tensorcast.cuda import cuda_available
from tensorcast.testing.vllm_engine import EngineProcess, llama_dir

sys.path.insert(0, str(Path(__file__).parent))
from benchlib import Table, parse_args, parser, pick, write_json

BLOCK = 32  # EngineProcess's block size


def tier_extra(address: str) -> dict[str, Any]:
    return {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 4 << 30,
            "secondary_tiers": [{"type": "TensorCastTier", "module_path": "tensorcast.integrations.vllm_tier",
                                 "address": address}]}


def run_engine(model: Path, address: str, prompts: list[list[int]], log: Path, tier: bool) -> list[dict[str, Any]]:
    kw: dict[str, Any] = {"connector": "OffloadingConnector", "kv_role": "kv_both", "extra": tier_extra(address)} \
        if tier else {"kv_role": None}
    with EngineProcess(model, address=address, host_id="gpu-host", dtype="float16", log_stats=True,
                       enable_prefix_caching=True, max_model_len=16384, log_path=log, **kw) as engine:
        engine.generate([1, 2, 3], 1)  # warm-up (kernels, graphs)
        return [engine.generate(p, 8) for p in prompts]


def main() -> None:
    args = parse_args(parser(__doc__, "2k and 8k-token prompts"))
    if not cuda_available() or importlib.util.find_spec("vllm") is None:
        print("needs a CUDA device and vLLM's CUDA build: vLLM's CPU build refuses the OffloadingConnector")
        sys.exit(2)
    lengths = pick(args, [1024, 2048, 4096, 8192], [2048, 8192], [512])
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tc-tier-") as tmp, \
            tc.LocalCluster(workers=1, config={"kv.memory_capacity": 8 << 30}) as cluster:
        model = llama_dir(Path(tmp) / "model", layers=8, hidden=1024, heads=8, kv_heads=8, intermediate=2816,
                          vocab=32000, seed=5, dtype="float16")
        prompts = [[(i * 7919 + n) % 31000 + 1 for i in range(n)] for n in lengths]
        recompute = run_engine(model, cluster.address, prompts, Path(tmp) / "ref.log", tier=False)
        run_engine(model, cluster.address, prompts, Path(tmp) / "a.log", tier=True)
        time.sleep(2.0)  # the tier's stores are asynchronous
        reused = run_engine(model, cluster.address, prompts, Path(tmp) / "b.log", tier=True)
        for n, ref, got in zip(lengths, recompute, reused, strict=True):
            assert got["tokens"] == ref["tokens"], f"{n} tokens: outputs differ"
            cached = got["num_cached_tokens"]
            assert cached >= (n - 1) // BLOCK * BLOCK - BLOCK, f"{n} tokens: only {cached} cached"
            rows.append({"prompt_tokens": n, "cached_tokens": cached, "recompute_ttft_s": ref["ttft"],
                         "tier_ttft_s": got["ttft"],
                         "ttft_reduction": 1 - got["ttft"] / ref["ttft"] if ref["ttft"] and got["ttft"] else None})
    table = Table(("prompt", ">8"), ("cached", ">8"), ("recompute TTFT", ">15.4f"), ("tier TTFT", ">10.4f"),
                  ("reduction", ">10.3f"))
    table.header()
    for r in rows:
        table.row(r["prompt_tokens"], r["cached_tokens"], r["recompute_ttft_s"], r["tier_ttft_s"], r["ttft_reduction"])
    print("\nengine B's outputs equal recompute's; its prompts came from engine A's units through the pool")
    write_json(args.json, "vllm_tier_check", args.quick, rows=rows)


if __name__ == "__main__":
    main()
