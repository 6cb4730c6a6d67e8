"""The weight-sync benchmark's model and measuring helpers (``benchmarks/weight_sync.py``).

Owns: the Qwen2-shaped state dict (shapes, random bf16 weights, the 10% delta, a training step that changes
tensors), tensor-parallel shards by the benchmark's rules (column-split, row-split, replicated) and their
digests, and the helpers both systems are measured with: CPU seconds per process, the memory check, medians
and ratios. Does not own: running either system or the report.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import time
from typing import Any

from benchlib import mem_available

GiB = 1 << 30

MODEL = "qwen-rl"
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")  # split dim 0
ROW = ("o_proj", "down_proj")  # split dim 1; everything else (norms) is replicated
# Qwen2.5-1.5B and -0.5B (config.json): hidden, heads, KV heads, MLP, vocabulary; both tie lm_head to the embedding.
QWEN_FULL = {"name": "Qwen2.5-1.5B", "hidden": 1536, "heads": 12, "kv_heads": 2, "inter": 8960, "vocab": 151936,
             "layers": 28}
QWEN_QUICK = {"name": "Qwen2.5-0.5B", "hidden": 896, "heads": 14, "kv_heads": 2, "inter": 4864, "vocab": 151936,
              "layers": 24}
# --smoke: the same tensors (names, biases, tied embeddings), a few MiB.
QWEN_SMOKE = {"name": "narrow Qwen2", "hidden": 128, "heads": 4, "kv_heads": 2, "inter": 256, "vocab": 2048,
              "layers": 4}


# ----------------------------------------------------------------------------------------------- the model
def qwen2_shapes(dims: dict[str, Any], layers: int) -> dict[str, tuple[int, ...]]:
    """Qwen2ForCausalLM's state-dict names and shapes (tied embeddings: no lm_head), ``layers`` layers."""
    h, inter, vocab = dims["hidden"], dims["inter"], dims["vocab"]
    kv = dims["kv_heads"] * (h // dims["heads"])
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out.update({
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.q_proj.bias": (h,),
            p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
    out["model.norm.weight"] = (h,)
    return out


def layers_for(dims: dict[str, Any], target: int) -> int:
    """The fewest layers (at most the real model's) that make the model at least ``target`` bytes."""
    fixed = sum(math.prod(s) for s in qwen2_shapes(dims, 0).values()) * 2
    per = sum(math.prod(s) for s in qwen2_shapes(dims, 1).values()) * 2 - fixed
    return max(1, min(int(dims["layers"]), -(-(target - fixed) // per)))


def nbytes_of(shape: tuple[int, ...]) -> int:
    return math.prod(shape) * 2  # bf16


def make_state(shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    out = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            out[name] = torch.empty(shape, dtype=torch.bfloat16).uniform_(-0.02, 0.02, generator=g)
    return out


def pick_delta(shapes: dict[str, tuple[int, ...]], frac: float = 0.1, seed: int = 7) -> list[str]:
    """``frac`` of the tensors, holding just under ``frac`` of the bytes: largest first while the byte budget
    allows (which layers: seeded at random), until the count is reached."""
    names = sorted(shapes)
    random.Random(seed).shuffle(names)
    names.sort(key=lambda n: -nbytes_of(shapes[n]))  # stable: equal sizes stay in random order
    want = max(1, round(frac * len(names)))
    budget = frac * sum(nbytes_of(s) for s in shapes.values())
    chosen: list[str] = []
    used = 0
    for n in names:
        if len(chosen) < want and used + nbytes_of(shapes[n]) <= budget:
            chosen.append(n)
            used += nbytes_of(shapes[n])
    for n in reversed(names):  # the budget ran out first: the smallest others make up the count
        if len(chosen) >= want:
            break
        if n not in chosen:
            chosen.append(n)
    return sorted(chosen)


def train_step(state: dict[str, Any], names: list[str]) -> None:
    """New weights for ``names``, in place: every value moves by one bf16 unit in the last place (new content
    at every step, so that no version deduplicates against an older one)."""
    import torch

    for n in names:
        state[n].view(torch.int16).add_(1)


def split_dim(name: str) -> int | None:
    if any(p in name for p in COLUMN):
        return 0
    if any(p in name for p in ROW):
        return 1
    return None


def shard_range(n: int, rank: int, world: int) -> tuple[int, int]:
    """``torch.chunk(x, world)[rank]`` along a dimension of size ``n``, as (start, stop)."""
    per = -(-n // world)
    lo = min(rank * per, n)
    return lo, min(lo + per, n)


def shard_shape(name: str, shape: tuple[int, ...], rank: int, world: int) -> tuple[int, ...]:
    dim = split_dim(name)
    if dim is None:
        return tuple(shape)
    lo, hi = shard_range(shape[dim], rank, world)
    return tuple(hi - lo if d == dim else s for d, s in enumerate(shape))


def shard_of(name: str, full: Any, rank: int, world: int) -> Any:
    dim = split_dim(name)
    if dim is None:
        return full
    lo, hi = shard_range(full.shape[dim], rank, world)
    return full.narrow(dim, lo, hi - lo)


def digest(t: Any) -> str:
    import blake3
    import torch

    return blake3.blake3(t.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


# ----------------------------------------------------------------------------------------------- helpers
def cpu_seconds(pids: list[int]) -> float:
    """CPU time (user + system) the processes ``pids`` have used so far; gone ones count 0. On a host shared
    with other work, the CPU an update costs is steadier than its wall time."""
    return sum(cpu_by_pid(pids).values())


def cpu_by_pid(pids: list[int]) -> dict[int, float]:
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: proc(5) 14, 15
    return out


def cpu_by_role(before: dict[int, float], after: dict[int, float], roles: dict[int, str]) -> dict[str, float]:
    """CPU seconds used between two ``cpu_by_pid`` readings, summed by role (trainer, w0, w1, ranks...)."""
    out: dict[str, float] = {}
    for pid, t in after.items():
        out[roles.get(pid, "other")] = out.get(roles.get(pid, "other"), 0.0) + t - before.get(pid, t)
    return {k: round(v, 3) for k, v in out.items()}


def ensure_memory(need: int, what: str, wait: float = 60.0) -> None:
    """Before each update: other work on this host may have taken the memory the run counted on. Wait a while
    for it to come back, then stop rather than push the host into its OOM killer (it may pick another's
    process)."""
    end = time.monotonic() + wait
    while (avail := mem_available()) < need:
        if time.monotonic() > end:
            raise SystemExit(f"stopping before {what}: {avail / GiB:.1f} GiB available, {need / GiB:.1f} GiB needed")
        time.sleep(2.0)


def summarize(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def ratio(base: dict[str, float], other: dict[str, float]) -> dict[str, float]:
    """base/other: the speed-up of ``other`` over ``base``, of medians, with the range from the extremes."""
    return {"median": base["median"] / other["median"], "min": base["min"] / other["max"],
            "max": base["max"] / other["min"]}
