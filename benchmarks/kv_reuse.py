"""KV reuse across vLLM instances: time to first token (TTFT) of a prompt whose long prefix another instance
computed, through TensorCast, against recomputing it, against the stores a user would pick instead, and
against the limit (the instance's own prefix-cache hit), all measured in one run (the paper's Fig 8/9,
scaled to a 2-core CPU host).

Setup: N vLLM CPU instances (``--instances``, default 2,4), each its own engine process with its own TensorCast
worker and host id (``running_cluster(workers=N, hosts=N)``: pages cross between "hosts" over loopback TCP, not
shared memory). The model has a real small model's shape and random weights (``--model``: ``smollm2-135m``,
SmolLM2-135M's: Llama, 30 layers, hidden 576, 9 heads, 3 KV heads, vocab 49152, the default; ``llama-0.5b``,
Qwen2-0.5B's dimensions on Llama, ~4x the compute per token), bf16 (what one serves on a CPU with AMX; ~3x
faster than fp32 here), written at run time (``--model-dir`` keeps it for the next run). vLLM's own prefix
cache is on in every instance, as in a deployment. A prompt of L tokens (``--lengths``) is L-32 random tokens
of prefix and a 32-token "question"; every measurement has a fresh prefix.

For each N, round (``--rounds``) and L, TTFT is vLLM's own (request arrival to first token, ``max_tokens=1``):
- prefill: instance 0 computes prefix+question alone (its connector stores the pages);
- reuse: instances 1..N-1 send the same prefix with their own question at the same time (instance 1 sends
  exactly instance 0's prompt: its first token must equal instance 0's). ``--reps`` times, their own prefix
  caches emptied in between (``reset_prefix_cache``) so that every repetition goes through the connector: one
  prefill yields several samples of the short request, the one this host's background load disturbs most;
- recompute (baseline): instances 1..N-1 compute a fresh prefix at the same time, TensorCast off per request:
  what the same instances do without sharing; "recompute alone" is instance 0's prefill above;
- local hit (the limit): then each asks ``--reps`` times for that prefix with another question: its own
  prefix cache, nothing crosses a process.
Every measured request comes after ``--settle`` idle seconds (right after a long prefill even a local hit is
3-10x slower here). Where the systems' instances fit in memory together (~2 GiB each), they start together
and, for each (round, L), take turns in alternating order, so that the host's background load falls on all
alike; otherwise (N=4 here) one system runs after the other. Each instance is one process (vLLM's engine
core and worker in it: ~1 GiB less than vLLM's three processes, and fewer hops per step).

Systems, each with its own N instances: ``tensorcast`` (``TensorCastConnector``, ``kv_both``); ``mooncake``:
vLLM's bundled ``MooncakeStoreConnector`` with configuration alone (``MOONCAKE_CONFIG_PATH``: a ``mooncake_master`` on
loopback, TCP, each instance lending a segment, the TCP transport's per-peer queues raised as its users do
(``MOONCAKE_TCP``); needs ``mooncake-transfer-engine-non-cuda`` and Debian ``libibverbs1``; its HTTP metadata
server binds all interfaces: run on a host with no other exposure);
``lmcache``: vLLM's bundled ``LMCacheConnectorV1`` with LMCache's ``lm://`` server (LMCache from the venv, or
from ``--lmcache-path``, a ``pip install --target DIR --no-deps`` directory put on the engines' PYTHONPATH
only: LMCache pins numpy<=2.2.6; one instance is started first to see whether it runs); ``offloading``: vLLM's
``OffloadingConnector``, one instance, prefix cache off (a repeated prefix can only come from its store).
A system that does not start, or starts without reusing anything, is reported with its exact error.

Statistics: a sample is one prefill, or one repetition's mean over the instances that ran at once; the table
gives the best sample (as ``benchlib.best_of``: the least disturbed, on a host shared with other work) and the
median. Ratios, from the best and from the medians: TensorCast's TTFT reduction vs recompute (same
concurrency) and vs recompute alone, and its TTFT over Mooncake's and over the local hit. Goals (reported,
not enforced): reduction >= 87.5% at the longest prompt, no worse than Mooncake at every length, within 1.5x
of the local hit.

``--quick``: N=2; L=1k,2k; 2 rounds x 5 repetitions; TensorCast, Mooncake and the OffloadingConnector probe;
LMCache only with ``--lmcache-path`` (~5 min here, half of it engine start-up). Full: N=2,4; L=1k,2k,4k,8k;
2 rounds x 5 repetitions; every system (~25 min here).

``--smoke``: N=2, L=64,128, one round, one repetition, 0.2 s settle, a two-layer model (figures meaningless;
every system that runs here, and every row). Needs vLLM like the rest (``benchmarks/smoke.py`` skips it without).

The stores' set-up is in ``kv_reuse_stores.py``, the statistics, goals, table and figure in ``kv_reuse_report.py``.

Usage: python benchmarks/kv_reuse.py [--quick | --smoke] [--instances 2,4] [--lengths 1024,8192] [--rounds R]
       [--reps K] [--systems tensorcast,mooncake,lmcache,offloading] [--json PATH] [--plot PATH] [--lmcache-path DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from benchlib import free_port, mem_available, parse_args, parser, pick, write_json
from kv_reuse_report import report
from kv_reuse_stores import (
    MOONCAKE_TCP,
    lmcache_env,
    lmcache_pythonpath,
    lmcache_server,
    mooncake_master,
    probe_lmcache,
)
from tensorcast.testing import running_cluster
from tensorcast.testing.vllm_engine import SMOLLM2_135M, EngineProcess, llama_dir

PAGE = 32  # tokens per vLLM block (the CPU backend needs a multiple of 32): the question is one page
OFF = {"tensorcast": {"load": False, "save": False}}  # TensorCast off for one request
MODELS: dict[str, dict[str, Any]] = {
    "smollm2-135m": SMOLLM2_135M,
    # Qwen2-0.5B's dimensions (without its q/k/v biases) on Llama: ~4x the compute per token of the above.
    "llama-0.5b": {"layers": 24, "hidden": 896, "heads": 14, "kv_heads": 2, "intermediate": 4864,
                   "vocab": 151936, "tie_embeddings": True},
    # --smoke's: two layers, head_dim 64 (what vLLM's CPU backend takes, as ``tiny_llama_dir``).
    "tiny": {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 512, "vocab": 512,
             "tie_embeddings": True},
}


class Prompts:
    """Deterministic random prompts: a fresh prefix per (length, round, use), the same in every system."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def prefix(self, length: int, rnd: int, use: str) -> list[int]:
        seed = [length, rnd, zlib.crc32(use.encode())]
        return [int(t) for t in np.random.default_rng(seed).integers(1, self.vocab - 1, length - PAGE)]

    def question(self, i: int) -> list[int]:
        return [int(t) for t in np.random.default_rng([7, i]).integers(1, self.vocab - 1, PAGE)]


def at_once(engines: list[EngineProcess], prompts: list[list[int]],
            params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One request per engine, all sent before any answer is read (each engine is its own process)."""
    for e, p in zip(engines, prompts, strict=True):
        e.submit(p, 1, params)
    return [e.result() for e in engines]


def ttft(r: dict[str, Any]) -> float:
    return float(r["ttft"] if r.get("ttft") else r["seconds"])


ENGINE_BYTES = 2 << 30  # an instance's own memory at 8k tokens here (1 GiB of KV cache, weights, vLLM)
WORKER_BYTES = 1 << 30  # a TensorCast worker's KV pages (kv.memory_capacity)


def batches(groups: dict[str, list[dict[str, Any]]], n: int) -> list[list[str]]:
    """Which systems run at the same time: all, if their engines fit in the memory available now (keeping
    2 GiB for the host's other work); else one at a time."""
    need = len(groups) * n * ENGINE_BYTES + n * WORKER_BYTES + (2 << 30)
    return [list(groups)] if need <= mem_available() else [[name] for name in groups]


def start_groups(groups: dict[str, list[dict[str, Any]]], stack: contextlib.ExitStack, status: dict[str, Any],
                 n: int) -> dict[str, list[EngineProcess]]:
    """Start every engine of ``groups`` at once and wait for all; a system whose engine fails is left out,
    its error in ``status``."""
    t0 = time.monotonic()
    started: dict[str, list[EngineProcess]] = {}
    for name, specs in groups.items():
        try:
            started[name] = [stack.enter_context(EngineProcess(**spec, wait=False)) for spec in specs]
        except Exception as exc:
            status[name] = f"N={n}: did not start: {exc}"
    for name, engines in list(started.items()):
        try:
            for e in engines:
                e.wait_ready()
        except Exception as exc:
            status[name] = f"N={n}: did not start: {exc}"
            for e in engines:
                e.close()
            del started[name]
    print(f"  {', '.join(started)}: {sum(map(len, started.values()))} engines ready in "
          f"{time.monotonic() - t0:.0f}s", flush=True)
    return started


def one_pass(system: str, engines: list[EngineProcess], prompts: Prompts, length: int, rnd: int, tag: str,
             settle: float, reps: int, baselines: bool) -> dict[str, Any]:
    """One measurement of one system on its N engines: instance 0 prefills, the others reuse at once (and,
    with ``baselines``, recompute a fresh prefix at once, then hit it in their own prefix cache).

    The reuse is repeated ``reps`` times, the reusing instances' own prefix caches emptied before each (so
    that the pages come through the connector again): one prefill, several samples of the short request,
    whose TTFT this host's background load disturbs the most. The local hit is repeated likewise."""
    first, others = engines[0], engines[1:]
    # Instance 1 asks exactly what instance 0 did (its first token must be the same); the others differ.
    questions = [prompts.question(i) for i in range(len(others))]
    shared = prompts.prefix(length, rnd, tag + "shared")
    pre = first.generate(shared + questions[0], 1)
    reuse: list[list[dict[str, Any]]] = []
    for _ in range(reps):
        if reuse:
            for e in others:
                e.reset_prefix_cache()
        # Connectors store asynchronously: let the prefill's pages land. Every measured request comes after
        # the same idle time: right after a long prefill an engine answers even a local hit 3-10x slower
        # (measured here: 8k tokens, 1.5 s right after vs 0.1-0.4 s after 2 s idle).
        time.sleep(settle)
        reuse.append(at_once(others, [shared + q for q in questions]))
    row: dict[str, Any] = {
        "system": system, "n": len(engines), "length": length, "round": rnd,
        "prefill_ttft": ttft(pre), "reuse_ttft": [[ttft(r) for r in rep] for rep in reuse],
        "reuse_cached": [[r["num_cached_tokens"] for r in rep] for rep in reuse],
        "first_token_match": all(rep[0]["tokens"] == pre["tokens"] for rep in reuse)}
    if baselines:
        fresh = prompts.prefix(length, rnd, tag + "fresh")
        time.sleep(settle)
        rec = at_once(others, [fresh + q for q in questions], OFF)
        hits = []
        for j in range(reps):
            time.sleep(settle)
            hits.append(at_once(others, [fresh + prompts.question(100 + 10 * j + i) for i in range(len(others))],
                                OFF))
        row.update({"recompute_ttft": [[ttft(r) for r in rec]],
                    "local_hit_ttft": [[ttft(r) for r in rep] for rep in hits],
                    "local_hit_cached": [[r["num_cached_tokens"] for r in rep] for rep in hits]})
    if not tag:
        def show(key: str) -> str:
            return " ".join("/".join(f"{t:.2f}" for t in rep) for rep in row[key])

        print(f"  {system:<11} N={len(engines)} L={length:>5} round {rnd}: prefill {row['prefill_ttft']:.2f}s"
              f" reuse {show('reuse_ttft')}s cached {row['reuse_cached'][0]}"
              + (f" | recompute {show('recompute_ttft')}s local hit {show('local_hit_ttft')}s" if baselines
                 else ""), flush=True)
    return row


def run_interleaved(started: dict[str, list[EngineProcess]], prompts: Prompts, lengths: list[int], rounds: int,
                    settle: float, reps: int, failed: dict[str, str]) -> list[dict[str, Any]]:
    """Every system's passes, interleaved: for each (round, length) each system in turn, in alternating
    order, so that the host's background load (shared, noisy) falls on all of them alike. A first short
    pass per system warms every code path (not kept). A system whose request fails is dropped from the
    rest of the run, its error in ``failed``."""
    warmup = max(2 * PAGE, min(lengths) // 2 // PAGE * PAGE)
    passes = [(warmup, 0, "warmup-")] + [(length, rnd, "") for rnd in range(rounds) for length in lengths]
    rows: list[dict[str, Any]] = []
    names = list(started)
    for k, (length, rnd, tag) in enumerate(passes):
        for name in names if k % 2 == 0 else names[::-1]:
            if name in failed:
                continue
            try:
                row = one_pass(name, started[name], prompts, length, rnd, tag, settle, 1 if tag else reps,
                               baselines=name == "tensorcast")
            except Exception as exc:  # e.g. an engine died: the other systems still run
                failed[name] = f"failed at {length} tokens: {type(exc).__name__}: {exc}"
                print(f"  {name}: {failed[name]}", flush=True)
                continue
            if not tag:
                rows.append(row)
    return rows


def main() -> None:
    ap = parser(__doc__, "N=2, L=1k,2k, 2 rounds, ~5 min")
    ap.add_argument("--instances", default=None, help="comma-separated N (default 2,4; quick, smoke 2)")
    ap.add_argument("--lengths", default=None, help="prompt tokens, multiples of 32 (default 1024,2048,4096,8192;"
                                                    " quick 1024,2048; smoke 64,128)")
    ap.add_argument("--rounds", type=int, default=None, help="fresh prefixes per length (default 2; smoke 1)")
    ap.add_argument("--systems", default="tensorcast,mooncake,lmcache,offloading")
    ap.add_argument("--model", choices=sorted(MODELS), default=None, help="default smollm2-135m (smoke: tiny)")
    ap.add_argument("--model-dir", default=None, help="where the random model is written (kept; reused if "
                                                      "present); default: a temporary directory")
    ap.add_argument("--reps", type=int, default=None,
                    help="reuse (and local hit) samples per prefill (default 5; smoke 1)")
    ap.add_argument("--settle", type=float, default=None,
                    help="idle seconds before each measured request (default 1.5; smoke 0.2)")
    ap.add_argument("--lmcache-path", default=os.environ.get("KV_REUSE_LMCACHE_PATH"),
                    help="a directory with LMCache (pip install --target DIR --no-deps lmcache ...), put on the "
                         "engines' PYTHONPATH only")
    ap.add_argument("--plot", default=None, help="PNG path (needs matplotlib)")
    ap.add_argument("--keep-logs", default=None, help="a directory for the engines' logs (default: a temporary "
                                                      "one, removed: the JSON has every error)")
    args = parse_args(ap)
    instances = [int(x) for x in (args.instances or pick(args, "2,4", "2", "2")).split(",")]
    lengths = [int(x) for x in (args.lengths or pick(args, "1024,2048,4096,8192", "1024,2048", "64,128")).split(",")]
    if any(n < 2 for n in instances) or any(L % PAGE or L < 2 * PAGE for L in lengths):
        ap.error("instances >= 2; lengths multiples of 32, >= 64")
    args.model = args.model or pick(args, "smollm2-135m", "smollm2-135m", "tiny")
    args.reps = args.reps or pick(args, 5, 5, 1)
    args.settle = pick(args, 1.5, 1.5, 0.2) if args.settle is None else args.settle
    rounds = args.rounds or pick(args, 2, 2, 1)
    t_start = time.monotonic()
    work = Path(args.keep_logs or tempfile.mkdtemp(prefix="kv_reuse-"))
    work.mkdir(parents=True, exist_ok=True)
    shape = MODELS[args.model]
    max_len = max(lengths) + 2 * PAGE
    model = Path(args.model_dir) if args.model_dir else work / "model"
    if not (model / "config.json").exists():
        t0 = time.monotonic()
        llama_dir(model, max_positions=max(max_len, 8192 + 2 * PAGE), dtype="bfloat16", **shape)
        print(f"model {args.model} (random weights, bf16) written in {time.monotonic() - t0:.0f}s", flush=True)
    rows: list[dict[str, Any]] = []
    status: dict[str, Any] = {}  # per system: "ran", or the exact error of what did not
    try:
        run_all(args, model, work, Prompts(shape["vocab"]), instances, lengths, rounds, max_len, rows, status)
    finally:
        if not args.keep_logs:
            shutil.rmtree(work, ignore_errors=True)
    summary, met, note = report(rows, status, instances, lengths, args.plot)
    write_json(args.json, "kv_reuse", args.quick, model=args.model, model_shape=shape, dtype="bfloat16",
               instances=instances, lengths=lengths, rounds=rounds, settle_s=args.settle, question_tokens=PAGE,
               systems=status, goals=met, summary=summary, rows=rows, plot=note or args.plot,
               seconds=time.monotonic() - t_start)
    print(f"total {time.monotonic() - t_start:.0f}s")


def run_all(args: argparse.Namespace, model: Path, work: Path, prompts: Prompts, instances: list[int],
            lengths: list[int], rounds: int, max_len: int, rows: list[dict[str, Any]], status: dict[str, Any]) -> None:
    """Every system at every N: the OffloadingConnector and the LMCache probe first, then for each N a cluster
    and each system's N engines. Appends to ``rows``; ``status`` gets each system's outcome."""
    systems = args.systems.split(",")
    # One process per instance (vLLM's engine core and worker in it): vLLM's default three processes take
    # ~1 GiB more per instance; and fewer hops per step on this oversubscribed host mean less scheduling
    # noise in a short request's TTFT. The same for every system.
    common = {"kv_role": "kv_both", "enable_prefix_caching": True, "max_model_len": max_len, "dtype": "bfloat16",
              "log_stats": True, "single_process": True}
    lmcache_path = lmcache_pythonpath(args.lmcache_path) if "lmcache" in systems and (
        args.lmcache_path or not args.quick) else None
    if "lmcache" in systems and lmcache_path is None:
        status["lmcache"] = ("not run: lmcache does not import here (it pins numpy<=2.2.6: install it with pip "
                             "install --target DIR --no-deps and pass --lmcache-path DIR)"
                             if args.lmcache_path or not args.quick else "not run (--quick without --lmcache-path)")
    if "offloading" in systems:
        status["offloading"] = bench_offloading(model, work, prompts, lengths, args.settle, max_len, rows)
    if lmcache_path is not None:
        status["lmcache"] = probe_lmcache(model, work, lmcache_path, max_len)
    for n in instances:
        print(f"N={n}: starting {n} instances per system", flush=True)
        with running_cluster(workers=n, hosts=n) as cluster, contextlib.ExitStack() as stack:
            groups: dict[str, list[dict[str, Any]]] = {}
            if "tensorcast" in systems:
                groups["tensorcast"] = [{"model_dir": model, "address": cluster.address,
                                         "host_id": cluster.host_id_of(i), "log_path": work / f"tc{n}-{i}.log",
                                         **common} for i in range(n)]
            if "mooncake" in systems:
                try:
                    config = stack.enter_context(mooncake_master(work))
                    groups["mooncake"] = [{
                        "model_dir": model, "address": cluster.address, "host_id": cluster.host_id_of(i),
                        "log_path": work / f"mc{n}-{i}.log", "connector": "MooncakeStoreConnector",
                        # A distinct lookup socket and transfer-engine name per instance on one host.
                        "extra": {"lookup_rpc_port": free_port()},
                        "env": {"MOONCAKE_CONFIG_PATH": str(config),
                                "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": f"127.0.0.1:{free_port()}", **MOONCAKE_TCP},
                        **common} for i in range(n)]
                except (OSError, RuntimeError) as exc:
                    status["mooncake"] = f"not run: {exc}"
            if lmcache_path is not None and status.get("lmcache") == "ran":
                url = stack.enter_context(lmcache_server(work, lmcache_path))
                groups["lmcache"] = [{
                    "model_dir": model, "address": cluster.address, "host_id": cluster.host_id_of(i),
                    "log_path": work / f"lmc{n}-{i}.log", "connector": "LMCacheConnectorV1",
                    "env": lmcache_env(lmcache_path, url), **common} for i in range(n)]
            # Groups start together where memory allows (start-up dominates; idle engines cost ~1.5% of a
            # core each) and take turns; otherwise one after the other.
            for batch in batches(groups, n):
                started = start_groups({k: groups[k] for k in batch}, stack, status, n)
                failed: dict[str, str] = {}
                got = run_interleaved(started, prompts, lengths, rounds, args.settle, args.reps, failed)
                rows += got
                for name, engines in started.items():
                    for e in engines:
                        e.close()
                    if name in failed:
                        status[name] = f"N={n}: {failed[name]}"
                    elif all(c == 0 for r in got if r["system"] == name for rep in r["reuse_cached"] for c in rep):
                        status[name] = f"N={n}: started but reused nothing (every reuse recomputed)"
                    else:
                        status.setdefault(name, "ran")
        # What is measured so far survives an interrupted run.
        write_json(args.json, "kv_reuse", args.quick, partial=True, systems=status, rows=rows)


def bench_offloading(model: Path, work: Path, prompts: Prompts, lengths: list[int], settle: float, max_len: int,
                     rows: list[dict[str, Any]]) -> str:
    """vLLM's OffloadingConnector, one instance, prefix cache off: a repeated prefix comes from its store."""
    try:
        engine = EngineProcess(model, address="-", host_id="-", kv_role="kv_both", connector="OffloadingConnector",
                               extra={"cpu_bytes_to_use": 1 << 30}, max_model_len=max_len, dtype="bfloat16",
                               log_stats=True, single_process=True, log_path=work / "offloading.log")
    except Exception as exc:
        return f"did not start: {exc}"
    with engine:
        for length in lengths:
            shared = prompts.prefix(length, 0, "shared")
            pre = engine.generate(shared + prompts.question(0), 1)
            time.sleep(settle)
            again = engine.generate(shared + prompts.question(1), 1)
            rows.append({"system": "offloading", "n": 1, "length": length, "round": 0, "prefill_ttft": ttft(pre),
                         "reuse_ttft": [[ttft(again)]], "reuse_cached": [[again["num_cached_tokens"]]],
                         "first_token_match": None})
    return "ran"


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
