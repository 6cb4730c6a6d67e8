"""Live evaluation of the routing and rebalancing policies: agent sessions replayed against 4 engine instances.

Owns: the live half of ``benchmarks/rebalance.py`` (``run_live``, ``add_live_arguments``), the options both
halves share (``add_policy_arguments``: the rebalancer's and the trace's) and a standalone entry point
(``python benchmarks/rebalance_live.py --quick --json PATH``; ``--smoke``: 2 instances, not 4, and 3 sessions of
~3 turns per policy, one repeat, a trace cut to 20 requests). It starts a local cluster (4 workers, one
tiny seeded HF Llama instance per worker, all replicas of the same weights), connects one client to the
gateway, and replays ``AgentWorkload`` sessions through each policy at N concurrent sessions:

- ``power-of-two``, ``cache-aware``: the router picks an instance per turn; only the instance's local prefix
  cache helps (the turn continues the session's previous request when it lands where that request is, else
  it recomputes; ``kv_reuse`` off);
- ``load-aware+shared``: least loaded per turn, the shared KV page store on (``kv_reuse``), plus the local
  continue when the turn lands where the session's previous request is;
- ``sticky+shared``: sessions stay where they were first placed (least loaded), shared store and local
  continue — the rebalancer's policy without moves, so its effect is isolated;
- ``tensorcast``: ``sticky+shared`` plus a ``Rebalancer`` ticking in the driver, whose moves run with
  ``MoveSession`` (publish the session's last request's KV, prefetch it to the target's worker, hydrate it
  there, reroute); the session's next turn continues locally on the target;
- ``tensorcast-local``: the same rebalancer over sticky sessions without the shared store: an instance never
  stores or looks up pages per turn, and KV moves only with a moved session (its plan publishes it).

Instances store a prefill's new KV pages before replying (``--kv-store sync``, the default: inside the TTFT of
every shared-store turn) or after (``--kv-store background``: a write-back cache, as SGLang's HiCache writes
to its storage backend after the request). On this 2-vCPU host the background store competes with the next
prefill for the CPU and the GIL, and did not lower TTFT in the one run that compared them (policies.md).

The driver is the gateway's router: it keeps one FIFO queue per instance and sends an instance one turn at a
time (an engine here serves one request at a time), so queueing is visible to it and counted in TTFT
(submit -> prefill reply). The load signals the policies see are ``list_instances()`` records (liveness, home
workers) with ``running`` = session caches the instance holds and ``waiting`` = turns queued for it, counted
by the driver: the instance heartbeat lags by its interval and cannot see turns queued in front of the engine.
Turn gaps are the preset's, multiplied by ``--time-scale`` (the runs are compressed in time; token counts by
``--live-scale``). Each policy's run relabels token ids with a seeded permutation of the vocabulary, so pages
stored by an earlier run can never be hit by a later one while lengths, gaps and prefix sharing stay
identical across policies.

With ``--trace PATH`` it then replays a Mooncake-format trace (``load_trace``: sessions from shared
``hash_ids`` prefixes, lengths x ``--trace-scale``, 1/32 by default, for CPU engines) through every policy,
once each: each request is issued at its recorded time x ``--time-scale`` (or when its session's previous
turn finished, if later), with ``--trace-limit`` requests (2000; ``--quick``: 400).

Does not own: the per-run driver (``live_driver.py``), the policies (``tensorcast.policies``), the workload
(``tensorcast.workloads``), the simulator half or the figures of ``benchmarks/rebalance.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import tensorcast as tc
from benchlib import Table, parse_args, parser, pick, pyplot, write_json
from live_driver import VOCAB, RunRecord, run_policy
from tensorcast.cluster import LocalCluster
from tensorcast.errors import InvalidArgument
from tensorcast.policies import (
    Move,
    MoveSession,
)
from tensorcast.workloads import load_trace

POLICIES = ("power-of-two", "cache-aware", "load-aware+shared", "sticky+shared", "tensorcast", "tensorcast-local")
INSTANCES = 4
SESSIONS = (8, 16, 32)
QUICK_SESSIONS = (8, 16)
SMOKE_SESSIONS = (3,)  # more sessions than (smoke) instances: one instance serves two
TABLE = Table(("sess", ">5"), ("policy", "<18"), ("turns", ">6"), ("med TTFT s", ">10.3f"), ("p90 TTFT s", ">10.3f"),
              ("hit", ">6.3f"), ("local", ">6.3f"), ("store", ">6.3f"), ("moved", ">6"), ("MB moved", ">9.2f"),
              ("load gap", ">8.2f"), ("wall s", ">7.1f"))


# ----------------------------------------------------------------- arguments
def add_policy_arguments(ap: argparse.ArgumentParser) -> None:
    """The options the simulated and the live run share: the rebalancer's settings and the trace to replay."""
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--interval", type=float, default=0.5, help="rebalancer tick, workload seconds")
    ap.add_argument("--gap", type=int, default=1, help="rebalancer gap in resident sessions that triggers a move")
    ap.add_argument("--max-moves", type=int, default=2, help="rebalancer moves per tick at most")
    ap.add_argument("--cooldown", type=float, default=60.0, help="workload seconds a moved session stays put")
    ap.add_argument("--spill", type=int, default=0,
                    help="tensorcast: a turn leaves its instance when it is busier than the least loaded by more "
                         "than this many requests (StickySessions spill; with the shared store only)")
    ap.add_argument("--trace", default=None, help="also replay this Mooncake-format JSONL trace (none by default)")
    ap.add_argument("--trace-scale", type=float, default=1 / 32, help="trace token lengths x this (default 1/32)")
    ap.add_argument("--trace-limit", type=int, default=None,
                    help="first N requests of the trace (0: all; default 2000, live --quick 400, live --smoke 20)")


def add_live_arguments(ap: argparse.ArgumentParser) -> None:
    """The options only the live run has (the harness's --quick, --smoke and --json, --plot, and
    ``add_policy_arguments``'s are added by ``rebalance.py`` and by the standalone entry point)."""
    ap.add_argument("--sessions", default=None, help="concurrent sessions, comma separated (default 8,16,32; "
                                                      "quick 8,16)")
    ap.add_argument("--gaps", default="fast", choices=("fast", "medium", "slow"), help="inter-turn gap preset")
    ap.add_argument("--time-scale", type=float, default=0.25,
                    help="multiply every gap and rebalancer period by this (runs compressed in time)")
    ap.add_argument("--live-scale", type=float, default=None,
                    help="workload token scale (default 0.1: ~200-token tool outputs; contexts reach 1-2k)")
    ap.add_argument("--live-turns", type=float, default=None,
                    help="mean turns per session (default 8; quick 6), at most 3x that")
    ap.add_argument("--rounds", type=int, default=None,
                    help="sessions each concurrency slot runs back to back (default 2)")
    ap.add_argument("--layers", type=int, default=4, help="tiny Llama layers per instance")
    ap.add_argument("--kv-store", choices=("sync", "background"), default="sync",
                    help="shared-store policies: an instance stores a prefill's new KV pages before replying "
                         "(sync) or after (background, as a write-back engine cache does)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="runs of every (sessions, policy), turns pooled (default 3; quick 2)")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma separated subset of " + ",".join(POLICIES))


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    quick = bool(args.quick)
    counts = pick(args, SESSIONS, QUICK_SESSIONS, SMOKE_SESSIONS) if not args.sessions else \
        tuple(int(x) for x in args.sessions.split(","))
    mean_turns = args.live_turns if args.live_turns is not None else pick(args, 8.0, 6.0, 3.0)
    policies = tuple(p for p in args.policies.split(",") if p)
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown or not policies:
        raise InvalidArgument(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    if args.time_scale <= 0 or any(n < 1 for n in counts) or (args.repeats is not None and args.repeats < 1):
        raise InvalidArgument("need --time-scale > 0, session counts >= 1 and --repeats >= 1")
    return {
        "quick": quick,
        "instances": pick(args, INSTANCES, INSTANCES, 2),  # --smoke: half the start-up
        "sessions": counts,
        "policies": policies,
        "gaps": args.gaps,
        "time_scale": args.time_scale,
        "scale": args.live_scale if args.live_scale is not None else 0.1,
        "mean_turns": mean_turns,
        "max_turns": max(int(mean_turns) + 2, int(3 * mean_turns)),
        "rounds": args.rounds if args.rounds is not None else pick(args, 2, 2, 1),
        "repeats": args.repeats if args.repeats is not None else pick(args, 3, 2, 1),
        "layers": args.layers,
        "kv_store": args.kv_store,
        "seed": getattr(args, "seed", 0),
        "interval_s": getattr(args, "interval", 0.5),
        "gap": getattr(args, "gap", 1),
        "max_moves": getattr(args, "max_moves", 2),
        "cooldown_s": getattr(args, "cooldown", 60.0),
        "spill": getattr(args, "spill", 0),
        "trace": getattr(args, "trace", None),
        "trace_scale": getattr(args, "trace_scale", 1 / 32),
        # The trace's first N requests (0: all): by default 2000, 400 with --quick (~140 s of trace), 20 with --smoke.
        "trace_limit": trace_limit if (trace_limit := getattr(args, "trace_limit", None)) is not None else
        pick(args, 2000, 400, 20),
    }


def summarize(name: str, n: int, s: dict[str, Any], runs: list[tuple[RunRecord, float]]) -> dict[str, Any]:
    """One row over every repeat of (policy, sessions): turns pooled, each repeat's median kept to show the
    run-to-run spread."""
    rec = RunRecord()
    for r, _ in runs:
        rec.turns += r.turns
        rec.moves += r.moves
        rec.load_gaps += r.load_gaps
        rec.errors += r.errors
    wall = sum(w for _, w in runs)
    ttft = np.array([t["ttft_s"] for t in rec.turns])
    prompt = sum(t["prompt_tokens"] for t in rec.turns)
    local = sum(t["local_tokens"] for t in rec.turns)
    shared = sum(t["shared_tokens"] for t in rec.turns)
    ok_moves = [m for m in rec.moves if m["ok"]]

    def ratio(a: float, b: float) -> float:
        return a / b if b else math.nan

    return {
        "policy": name, "preset": s["gaps"], "sessions": n, "turns": len(rec.turns),
        "median_ttft_s": float(np.median(ttft)) if len(ttft) else math.nan,
        "p90_ttft_s": float(np.percentile(ttft, 90)) if len(ttft) else math.nan,
        "mean_ttft_s": float(ttft.mean()) if len(ttft) else math.nan,
        "mean_queue_s": float(np.mean([t["queue_s"] for t in rec.turns])) if rec.turns else math.nan,
        "hit_rate": ratio(local + shared, prompt), "local_hit_rate": ratio(local, prompt),
        "store_hit_rate": ratio(shared, prompt),
        "sessions_moved": len({m["session"] for m in ok_moves}), "moves": len(ok_moves),
        "failed_moves": len(rec.moves) - len(ok_moves), "bytes_moved": sum(m["bytes"] for m in ok_moves),
        "mean_load_gap": float(np.mean(rec.load_gaps)) if rec.load_gaps else math.nan,
        "wall_s": wall, "errors": rec.errors[:10], "error_count": len(rec.errors), "repeats": len(runs),
        "median_ttft_by_repeat_s": [float(np.median([t["ttft_s"] for t in r.turns])) if r.turns else math.nan
                                    for r, _ in runs],
        "_samples": rec.turns, "_moves": rec.moves,
    }


def show(row: dict[str, Any]) -> None:
    TABLE.row(row["sessions"], row["policy"], row["turns"], row["median_ttft_s"], row["p90_ttft_s"], row["hit_rate"],
              row["local_hit_rate"], row["store_hit_rate"], row["sessions_moved"], row["bytes_moved"] / 1e6,
              row["mean_load_gap"], row["wall_s"])


# ----------------------------------------------------------------- cluster and entry points
def measure_prefill(layers: int) -> dict[str, float]:
    """Prefill seconds of the instance's model in this process (one thread, as the instances run), so the
    report says what a turn costs on this CPU."""
    import torch

    from tensorcast.instance.hf import HFCausalLMAdaptor, tiny_llama

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = HFCausalLMAdaptor(tiny_llama(0, layers=layers))
        ids = [int(t) for t in np.random.default_rng(0).integers(0, VOCAB, 2048)]
        out = {}
        for n in (256, 1024, 2048):
            a.prefill("warm", ids[:n])
            best = math.inf
            for _ in range(3):
                t0 = time.perf_counter()
                a.prefill("x", ids[:n])
                best = min(best, time.perf_counter() - t0)
            out[f"prefill_{n}_s"] = best
        t0 = time.perf_counter()
        a.generate("x", 16)
        out["decode_token_s"] = (time.perf_counter() - t0) / 16
        return out
    finally:
        torch.set_num_threads(threads)


def warm_up(client: tc.Client, ids: list[str]) -> None:
    """One prefill with the shared store, one decode and one move per instance before anything is measured:
    first calls pay for imports, connections and allocations that no policy should be charged for. The
    prompts are drawn from a stream no run uses, and every request is dropped afterwards."""
    from tensorcast.policies import SessionTable

    rng = np.random.default_rng(0xC0FFEE)
    mover = MoveSession(client, SessionTable(), timeout=60)
    listed = client.list_instances()
    for k, inst in enumerate(ids):
        rid = f"warm-up/{inst}"
        prompt = [int(t) for t in rng.integers(0, VOCAB, 300)]
        for reuse in (True, False):
            client.call_instance(inst, "engine", args={"command": "prefill", "request_id": rid,
                                                       "input_ids": prompt, "kv_reuse": reuse})
        client.call_instance(inst, "engine", args={"command": "generate", "request_id": rid, "max_new_tokens": 4})
        target = ids[(k + 1) % len(ids)]
        mover.run(Move(rid, inst, target, len(prompt), rid, -1.0 - k), listed)
        for where in (inst, target):
            client.call_instance(where, "engine", args={"command": "drop", "request_id": rid})


def run_live(args: argparse.Namespace) -> dict[str, Any]:
    """Run every policy at every session count on a fresh 4-instance cluster; returns ``rows`` (one per
    policy and count), ``calibration_samples`` (per turn and per move) and the settings."""
    s = _settings(args)
    costs = measure_prefill(s["layers"])
    print(f"live: {s['instances']} HF tiny-llama instances ({s['layers']} layers, hidden 64, vocab {VOCAB}, float32, "
          f"1 thread each) on {platform.machine()} with {_cpus()} CPUs; prefill 256/1024/2048 tokens = "
          f"{costs['prefill_256_s'] * 1e3:.1f}/{costs['prefill_1024_s'] * 1e3:.1f}/"
          f"{costs['prefill_2048_s'] * 1e3:.1f} ms, decode {costs['decode_token_s'] * 1e3:.1f} ms/token")
    print(f"workload: AgentWorkload(gaps={s['gaps']!r}, mean_turns={s['mean_turns']}, max_turns={s['max_turns']}, "
          f"scale={s['scale']}), gaps x {s['time_scale']} (compressed), {s['rounds']} session(s) per slot; "
          f"rebalancer interval {s['interval_s']} x {s['time_scale']} s, gap {s['gap']}, "
          f"max moves {s['max_moves']}, cooldown {s['cooldown_s']} x {s['time_scale']} s")
    rows: list[dict[str, Any]] = []
    samples: list[dict[str, Any]] = []
    move_samples: list[dict[str, Any]] = []
    t0 = time.monotonic()
    with LocalCluster(workers=s["instances"]) as cluster:
        ids = [f"inst-{i}" for i in range(s["instances"])]
        for i, inst_id in enumerate(ids):
            cluster.start_instance(inst_id, f"w{i}", ["--seed", "0", "--layers", str(s["layers"])] +
                                   (["--kv-store-in-background"] if s["kv_store"] == "background" else []))
        with tc.connect(cluster.address) as client:
            warm_up(client, ids)
            print(f"cluster up and warm in {time.monotonic() - t0:.1f} s", flush=True)
            TABLE.header()
            runs: dict[tuple[int, str], list[tuple[RunRecord, float]]] = {}
            run_index = 0
            # Repeats go round every (sessions, policy) pair in turn, so slow spells of a shared host spread
            # over all policies rather than landing on one.
            for repeat in range(s["repeats"]):
                for n in s["sessions"]:
                    for name in s["policies"]:
                        rec, wall = run_policy(client, ids, name, n, s, run_index)
                        run_index += 1
                        runs.setdefault((n, name), []).append((rec, wall))
                        samples += [{"policy": name, "sessions": n, "repeat": repeat, **t} for t in rec.turns]
                        move_samples += [{"policy": name, "sessions": n, "repeat": repeat, **m} for m in rec.moves]
                        if s["repeats"] > 1:
                            print(f"  repeat {repeat}: {n} sessions, {name}: {len(rec.turns)} turns, "
                                  f"{wall:.1f} s", flush=True)
            for n in s["sessions"]:
                for name in s["policies"]:
                    row = summarize(name, n, s, runs[(n, name)])
                    row.pop("_samples")
                    row.pop("_moves")
                    rows.append(row)
                    show(row)
            verdict = compare(rows, s["sessions"])
            trace_rows, trace_verdict = run_trace(client, ids, s, run_index)
    return {"mode": "live", "settings": s, "model_costs": costs, "rows": rows, "verdict": verdict,
            "trace": trace_rows, "trace_verdict": trace_verdict,
            "calibration_samples": {"turns": samples, "moves": move_samples},
            "total_wall_s": time.monotonic() - t0}


def run_trace(client: tc.Client, ids: list[str], s: dict[str, Any],
              run_index: int) -> tuple[list[dict[str, Any]], list[str]]:
    """Replay the Mooncake-format trace ``--trace`` through every policy, once each, at its arrival times x
    ``--time-scale``; nothing (and said so) without one."""
    if not s["trace"]:
        print("\nlive trace replay: skipped (no --trace PATH given; a Mooncake-format JSONL trace)")
        return [], []
    limit = s["trace_limit"] if s["trace_limit"] > 0 else None
    sessions = load_trace(s["trace"], scale=s["trace_scale"], limit=limit, vocab_size=VOCAB)
    turns = [t for x in sessions for t in x.turns]
    span = max((t.arrival_s or 0.0) for t in turns) * s["time_scale"]
    print(f"\nlive trace replay: {len(turns)} requests in {len(sessions)} sessions "
          f"({sum(len(x.turns) > 1 for x in sessions)} of more than one turn), lengths x {s['trace_scale']}, "
          f"arrival times x {s['time_scale']} ({span:.0f} s); 'sess' = sessions in the trace", flush=True)
    TABLE.header()
    rows = []
    for k, name in enumerate(s["policies"]):
        rec, wall = run_policy(client, ids, name, len(sessions), s, run_index + k, trace=sessions)
        row = summarize(name, len(sessions), s, [(rec, wall)])
        row["preset"] = "trace"
        row.pop("_samples")
        row.pop("_moves")
        rows.append(row)
        show(row)
    return rows, compare(rows, (len(sessions),))


def compare(rows: list[dict[str, Any]], counts: tuple[int, ...]) -> list[str]:
    """Plain statements of who won, printed whatever the answer: the lowest median TTFT, and each TensorCast
    policy (``tensorcast``: over the shared store; ``tensorcast-local``: without it) against load-aware +
    shared KV."""
    lines = []
    for n in counts:
        at = [r for r in rows if r["sessions"] == n and not math.isnan(r["median_ttft_s"])]
        if not at:
            continue
        best = min(at, key=lambda r: r["median_ttft_s"])
        base = next((r for r in at if r["policy"] == "load-aware+shared"), None)
        line = f"{n} sessions: lowest median TTFT {best['policy']} ({best['median_ttft_s'] * 1e3:.1f} ms)"
        ours = [r for r in at if r["policy"].startswith("tensorcast")]
        for r in ours if base is not None else []:
            assert base is not None
            cut = 100 * (1 - r["median_ttft_s"] / base["median_ttft_s"])
            line += (f"; {r['policy']} vs load-aware+shared: median TTFT {r['median_ttft_s'] * 1e3:.1f} vs "
                     f"{base['median_ttft_s'] * 1e3:.1f} ms (cut {cut:+.1f}%; negative = slower), hit rate "
                     f"{r['hit_rate']:.3f} vs {base['hit_rate']:.3f}")
        if ours and not best["policy"].startswith("tensorcast"):
            line += " — no TensorCast policy has the lowest median TTFT here"
        lines.append(line)
    print()
    for line in lines:
        print(line)
    return lines


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """One PNG: median and p90 TTFT and hit rate vs concurrent sessions, per policy."""
    plt = pyplot()
    if plt is None:
        print("plot: skipped (matplotlib is not installed)")
        return

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels: list[tuple[str, str, Callable[[float], float]]] = [
        ("median_ttft_s", "median TTFT (ms)", lambda v: v * 1e3), ("p90_ttft_s", "p90 TTFT (ms)", lambda v: v * 1e3),
        ("hit_rate", "cache hit rate (local + store)", lambda v: v)]
    for ax, (key, label, f) in zip(axes, panels, strict=True):
        for name in POLICIES:
            pts = sorted((r["sessions"], f(r[key])) for r in rows if r["policy"] == name)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_xlabel("concurrent sessions")
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.suptitle("LIVE: 4 HF tiny-llama instances, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def main() -> None:
    ap = parser(__doc__, "8 and 16 sessions, shorter sessions, a few minutes")
    ap.add_argument("--plot", default=None, help="write a PNG here")
    add_policy_arguments(ap)
    add_live_arguments(ap)
    args = parse_args(ap)
    results = run_live(args)
    if args.plot:
        plot(results["rows"], args.plot)
    write_json(args.json, "rebalance", args.quick, **results)  # results["mode"] is "live"


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
