"""KV rebalancing: median and p90 TTFT and cache hit rate vs concurrent agent sessions, for each routing policy
and each inter-turn gap preset, plus a Mooncake-format trace replay.

``--live`` runs the same policies on four live engine instances (``rebalance_live.py``, whose docstring says
how; ``docs/policies.md`` "Live evaluation"). ``--sim`` runs the discrete-event simulator (``tensorcast.sim``,
``docs/simulator.md``) with the policy classes of ``tensorcast.policies`` unchanged:

- ``power-of-two``: ``PowerOfTwo`` on load; no shared store (what is not in the instance's cache is recomputed);
- ``cache-aware``: ``CacheAware()`` with SGLang's gateway defaults; no shared store;
- ``load-aware+shared``: ``LoadAwareShared`` on every turn, and a shared KV store: a local miss loads whatever
  the store holds (every prompt and output block any instance published) instead of recomputing it;
- ``sticky+shared``: ``StickySessions(LoadAwareShared())`` and the shared store, no rebalancer (the ablation
  that shows the imbalance sticky sessions build up);
- ``tensorcast``: the same plus ``Rebalancer`` ticked every ``--interval`` seconds; each ``Move`` costs
  publish + prefetch + hydrate of the session's KV and, when done, the session table sends its next turn to the
  target (what ``MoveSession`` does with one plan on a live cluster); and ``StickySessions(..., spill=--spill)``:
  a turn whose instance is busier than the least loaded one (by more than ``--spill`` requests) goes there and
  reads its context from the store;
- ``tensorcast-local``: the rebalancer without the store (and so without spilling: a turn elsewhere would
  recompute its session).

Setup (why the sessions pile up): 4 instances, each running at most 16 requests, each holding ``2**19 x
--scale`` tokens of KV in 16-token blocks (32768 at the default scale 1/16: about a third of the live contexts
of 256 sessions, for the cache pressure the paper reports). ``N`` concurrent sessions (``ClosedLoop``): every
slot starts at a random time in the first half of a mean session lifetime and starts a new agent session when
its session ends. A router only sees ``running + waiting``, in which idle sessions do not count, so a sticky
router places each new session on the instance that is least busy *now*, whatever long-lived sessions it
already holds; which sessions live long and grow large is not known when they are placed. The load gap column
(most minus least loaded instance, averaged over routing decisions) shows the imbalance that leaves. Sessions
run until ``--lifetimes`` mean session lifetimes (``mean_turns`` x mean gap); the first lifetime is warm-up
and is not measured.

All numbers come from the simulator with the cost model's **placeholder** coefficients (``CostModel()``: a small
model on CPU, uncalibrated) unless ``--cost PATH`` gives a fitted model (``CostModel.to_dict`` JSON). The goals
(the paper's cuts of 71.4 / 93.2 / 70.4 % of median TTFT against load-aware + shared KV for fast / medium /
slow, at 128 / 256 / 256 sessions) are reported next to what the simulator gives, not enforced. The trace
replay scales the trace's lengths by ``--trace-scale`` (1/32 by default: at 1/16 the placeholder CPU model
cannot keep up with the trace's ~3 requests/s) and keeps its arrival times.

``--sim --smoke``: 4 and 8 sessions of short sessions for 2 lifetimes (figures meaningless; every preset and
policy); ``benchmarks/smoke.py`` passes a small generated trace, for the replay's path.

Usage: python benchmarks/rebalance.py --sim [--quick | --smoke] [--json PATH] [--plot PREFIX] [--trace PATH]
       [--cost PATH] [--scale S] [--seed N] [--interval S] [--gap N] [--max-moves N] [--cooldown S] [--spill N]
       python benchmarks/rebalance.py --live [--quick | --smoke] [--json PATH] [--plot PREFIX] [--sessions 8,16,32]
       [--gaps fast|medium|slow] [--gap N] ... (``rebalance_live.py --help``)
       python benchmarks/rebalance.py --fit LIVE_JSON [--cost-out COST_JSON]   (then --sim --cost COST_JSON)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import time
from typing import Any

import rebalance_live
from benchlib import Table, parse_args, parser, pick, pyplot, write_json
from live_driver import SHARED_KV
from sim_check import check_live
from tensorcast.errors import InvalidArgument
from tensorcast.policies import CacheAware, LoadAwareShared, PowerOfTwo, Rebalancer, StickySessions
from tensorcast.sim import (
    ClosedLoop,
    CostModel,
    DecodeSample,
    OverheadSample,
    Policy,
    PrefillSample,
    Replay,
    SimConfig,
    busy_overlap,
    fit,
    fit_overheads,
    fit_transfer,
    simulate,
)
from tensorcast.workloads import AgentWorkload, load_trace

PRESETS = ("fast", "medium", "slow")
SESSIONS = (16, 32, 64, 128, 256)
QUICK_SESSIONS = (16, 64)
SMOKE_SESSIONS = (4, 8)
POLICIES = ("power-of-two", "cache-aware", "load-aware+shared", "sticky+shared", "tensorcast", "tensorcast-local")
BASELINE, OURS = "load-aware+shared", ("tensorcast", "tensorcast-local")
KV_TOKENS_AT_SCALE_1 = 1 << 19  # per instance: 32768 tokens at the default scale 1/16
# The paper's median-TTFT cuts against load-aware + shared KV (its Fig. 10), at its heaviest load per preset.
PAPER_CUTS = {"fast": (71.4, 128), "medium": (93.2, 256), "slow": (70.4, 256)}


def make_policy(name: str, args: Any) -> Policy:
    """A fresh policy (policy objects keep state: one per run). ``tensorcast``: sticky sessions over a shared page
    store plus the rebalancer; ``tensorcast-local``: the same without the store (KV moves only with sessions)."""
    if name == "power-of-two":
        return Policy(name, PowerOfTwo(seed=args.seed))
    if name == "cache-aware":
        return Policy(name, CacheAware())
    if name == "load-aware+shared":
        return Policy(name, LoadAwareShared(), shared_kv=True)
    if name == "sticky+shared":
        return Policy(name, StickySessions(LoadAwareShared()), shared_kv=True)
    rebalancer = Rebalancer(interval_s=args.interval, gap=args.gap, max_moves_per_tick=args.max_moves,
                            cooldown_s=args.cooldown)
    shared = name == "tensorcast"  # with the store a turn may leave a busy instance (spill); without, it stays
    return Policy(name, StickySessions(LoadAwareShared(), spill=args.spill if shared else None), shared_kv=shared,
                  rebalancer=rebalancer)


def workload(preset: str, args: argparse.Namespace) -> AgentWorkload:
    if args.quick:  # shorter sessions
        return AgentWorkload(gaps=preset, scale=args.scale, seed=args.seed, mean_turns=8.0, max_turns=20)
    return AgentWorkload(gaps=preset, scale=args.scale, seed=args.seed)


def lifetime_s(wl: AgentWorkload) -> float:
    """A session's mean lifetime, roughly: its mean turn count times the mean inter-turn gap."""
    return wl.mean_turns * math.exp(wl.gap.mu + wl.gap.sigma ** 2 / 2)


def run_point(policy_name: str, wl: AgentWorkload, sessions: int, config: SimConfig,
              args: argparse.Namespace) -> dict[str, Any]:
    life = lifetime_s(wl)
    arrivals = ClosedLoop(wl, sessions, horizon_s=args.lifetimes * life, ramp_s=life / 2)
    t0 = time.perf_counter()
    result = simulate(make_policy(policy_name, args), arrivals, config, seed=args.seed)
    wall = time.perf_counter() - t0
    return {"policy": policy_name, "sessions": sessions, "wall_s": wall,
            **{k: v for k, v in result.summary(since_s=life).items() if k != "sessions"},
            "sessions_started": result.sessions, "warmup_s": life, "horizon_s": arrivals.horizon_s}


TABLE = Table(("preset", "<7"), ("sess", ">5"), ("policy", "<18"), ("turns", ">6.0f"), ("med TTFT s", ">10.3f"),
              ("p90 TTFT s", ">10.3f"), ("hit", ">6.3f"), ("local", ">6.3f"), ("store", ">6.3f"), ("moved", ">6.0f"),
              ("MB moved", ">9.1f"), ("load gap", ">8.2f"), ("wall s", ">7.2f"))


def show(preset: str, row: dict[str, Any]) -> None:
    TABLE.row(preset, row["sessions"], row["policy"], row["turns"], row["median_ttft_s"], row["p90_ttft_s"],
              row["hit_rate"], row["local_hit_rate"], row["store_hit_rate"], row["sessions_moved"],
              row["bytes_moved"] / 1e6, row["mean_load_gap"], row["wall_s"])


def run_sim(args: argparse.Namespace) -> dict[str, Any]:
    """Every preset x session count x policy; the table as it goes, then the comparison with the paper."""
    config = sim_config(args)
    counts = pick(args, SESSIONS, QUICK_SESSIONS, SMOKE_SESSIONS)
    TABLE.header()
    rows: list[dict[str, Any]] = []
    for preset in PRESETS:
        wl = workload(preset, args)
        for n in counts:
            for name in POLICIES:
                row = {"preset": preset, **run_point(name, wl, n, config, args)}
                rows.append(row)
                show(preset, row)
    print()
    verdicts = compare(rows, counts)
    trace_rows = run_trace(args, config)
    return {"rows": rows, "trace": trace_rows, "verdicts": verdicts}


def _busy_overlaps(turns: list[dict[str, Any]]) -> dict[int, tuple[float, float]]:
    """For each turn of a live run: how many other instances were busy (serving a turn) during its prefill and
    during its decoding, on average (``sim.cost.busy_overlap``). Turns of one point run together."""
    out: dict[int, tuple[float, float]] = {}
    points: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in turns:
        points.setdefault((r["policy"], r["sessions"], r["repeat"], r.get("preset")), []).append(r)
    for rows in points.values():
        spans = {id(r): (r["issued_s"] + r["queue_s"], r["issued_s"] + r["queue_s"] + r["prefill_call_s"],
                         r["issued_s"] + r["queue_s"] + r["prefill_call_s"] + r["decode_call_s"]) for r in rows}
        by_instance: dict[str, list[tuple[float, float]]] = {}
        for r in rows:
            start, _, end = spans[id(r)]
            by_instance.setdefault(r["instance"], []).append((start, end))
        for r in rows:
            start, mid, end = spans[id(r)]
            others = {k: v for k, v in by_instance.items() if k != r["instance"]}
            out[id(r)] = (busy_overlap(start, mid, others), busy_overlap(mid, end, others))
    return out


def fit_live(path: str, out: str | None) -> dict[str, Any]:
    """Fit the simulator's cost model to a live run's samples (``--live --json PATH`` writes them): prefill on
    (computed, cached tokens, other instances busy) -> the forward's seconds, a turn's decoding on (steps,
    context, other instances busy) -> the call's seconds, a prefill call's overheads with and without the shared
    store, the KV bytes per token from the moves, and a copy's latency from the shared-store reads. Held out:
    the live run's last repeat (a run the fit never saw), or a random quarter when there was one repeat. Writes
    the model (``--cost`` reads it) to ``out``."""
    with open(path) as f:
        live = json.load(f)
    turns = live["calibration_samples"]["turns"]
    moves = [m for m in live["calibration_samples"]["moves"] if m.get("ok") and m["kv_tokens"]]

    busy = _busy_overlaps(turns)

    def prefill(rows: list[dict[str, Any]]) -> list[PrefillSample]:
        return [PrefillSample(r["computed_tokens"], r["local_tokens"] + r["shared_tokens"], r["prefill_s"],
                              busy[id(r)][0]) for r in rows if r["prefill_s"] > 0]

    # One call decodes a turn's whole output: a setup and as many steps as the simulator runs after the first
    # token (output - 1; the live call runs one more pass, which the setup ``r`` takes in).
    def decode(rows: list[dict[str, Any]]) -> list[DecodeSample]:
        return [DecodeSample(r["decode_batch"], r["decode_context"], r["decode_call_s"], busy[id(r)][1],
                             steps=r["decode_tokens"] - 1) for r in rows if r["decode_tokens"] > 0]

    last = max(r["repeat"] for r in turns)
    train = [r for r in turns if r["repeat"] != last] if last else turns
    held = [r for r in turns if r["repeat"] == last] if last else None
    base = CostModel()
    if moves:  # a move's bytes are the session's KV: what a token of context weighs in this model
        base = dataclasses.replace(base, kv_bytes_per_token=round(sum(m["bytes"] for m in moves) /
                                                                  sum(m["kv_tokens"] for m in moves)))
    reads = [r for r in train if r["shared_tokens"] and r["shared_read_s"] > 0]
    if reads:  # a load from the shared store is one copy: its latency and bandwidth
        latency, bandwidth = fit_transfer([(r["shared_tokens"] * base.kv_bytes_per_token, r["shared_read_s"])
                                           for r in reads], base.transfer_bandwidth)
        base = dataclasses.replace(base, transfer_latency_s=latency, transfer_bandwidth=bandwidth)
    # A prefill call beyond its forward pass and its reads: the call itself; with a shared store (the policies
    # that use one), looking its pages up and storing the new ones before the reply.
    result = fit(prefill(train), decode(train), base=base, test_prefill=prefill(held) if held else None,
                 test_decode=decode(held) if held else None)
    overheads = [OverheadSample(r["computed_tokens"], r["policy"] in SHARED_KV,
                                max(0.0, r["prefill_call_s"] - r["prefill_s"] - r["shared_read_s"]), busy[id(r)][0])
                 for r in train if r["prefill_s"] > 0]
    try:  # for an instance alone, as the simulator slows them down with the prefill
        o, s0, s1 = fit_overheads(overheads, result.model.prefill_contention)
        result = dataclasses.replace(result, model=dataclasses.replace(
            result.model, request_overhead_s=o, store_base_s=s0, store_per_token_s=s1))
    except InvalidArgument as exc:  # a run of shared-store policies only, or of local ones only
        print(f"overheads not fitted ({exc.message}): the model charges none")
    how = f"held-out repeat {last}" if last else "a held-out random quarter"
    print(f"cost model fitted to {path}: {len(train)} turns; error on {how}:")
    for name, err in (("prefill", result.prefill_error), ("decode call", result.decode_error)):
        print(f"  {name:<12} median {err.median:.1%}, p90 {err.p90:.1%} over {err.samples} samples "
              f"({'within' if err.median < 0.15 else 'above'} the 15% goal)")
    print(f"  {result.model}")
    if out:
        with open(out, "w") as f:
            json.dump(result.model.to_dict(), f, indent=1)
        print(f"cost model: {out} (use with --sim --cost {out})")
    return {"model": result.model.to_dict(), "held_out": how,
            "prefill_error": dataclasses.asdict(result.prefill_error),
            "decode_error": dataclasses.asdict(result.decode_error)}


def sim_config(args: argparse.Namespace) -> SimConfig:
    cost = CostModel()
    if args.cost:
        with open(args.cost) as f:
            cost = CostModel.from_dict(json.load(f))
    # KV per instance scales with the workload's token lengths, so the cache pressure is the same at any scale.
    return SimConfig(instances=4, max_batch=16, kv_capacity_tokens=max(1024, round(KV_TOKENS_AT_SCALE_1 * args.scale)),
                     block_tokens=16, cost=cost)


def _row(rows: list[dict[str, Any]], preset: str, n: int, policy: str) -> dict[str, Any] | None:
    return next((r for r in rows if (r["preset"], r["sessions"], r["policy"]) == (preset, n, policy)), None)


def compare(rows: list[dict[str, Any]], counts: tuple[int, ...]) -> list[str]:
    """Print (and return) the goals' verdicts: the rebalancer's median-TTFT cut against load-aware + shared KV
    at the largest count run and at the paper's count when run, who has the lowest median TTFT, and each
    policy's hit-rate drop from the fewest to the most sessions."""
    lines: list[str] = []
    for preset in PRESETS:
        paper, paper_n = PAPER_CUTS[preset]
        for n in sorted({counts[-1], paper_n} & set(counts)):
            base = _row(rows, preset, n, BASELINE)
            for name in OURS:
                ours = _row(rows, preset, n, name)
                if base is None or ours is None:
                    continue
                cut = 100 * (1 - ours["median_ttft_s"] / base["median_ttft_s"])
                lines.append(f"{preset}, {n} sessions: {name} median TTFT {ours['median_ttft_s']:.3f} s vs "
                             f"load-aware+shared {base['median_ttft_s']:.3f} s: cut {cut:+.1f}% "
                             f"(paper, {paper_n} sessions: {paper}%)")
        for n in counts:
            at = [r for r in rows if r["preset"] == preset and r["sessions"] == n]
            best = min(at, key=lambda r: r["median_ttft_s"])
            ours_best = min((r["median_ttft_s"] for r in at if r["policy"] in OURS), default=None)
            if ours_best is not None and ours_best > best["median_ttft_s"]:  # a tie counts as lowest
                lines.append(f"{preset}, {n} sessions: no TensorCast policy has the lowest median TTFT "
                             f"({best['policy']}: {best['median_ttft_s']:.3f} s)")
        drops = []
        for name in POLICIES:
            lo, hi = _row(rows, preset, counts[0], name), _row(rows, preset, counts[-1], name)
            if lo is not None and hi is not None:
                drops.append((lo["hit_rate"] - hi["hit_rate"], name))
        drops.sort()
        lines.append(f"{preset}: hit-rate drop {counts[0]} -> {counts[-1]} sessions: "
                     + ", ".join(f"{name} {100 * d:+.1f} pts" for d, name in drops)
                     + f" (smallest: {drops[0][1]})")
    for line in lines:
        print(line)
    return lines


def run_trace(args: argparse.Namespace, config: SimConfig) -> list[dict[str, Any]]:
    """Replay ``--trace`` (Mooncake JSONL) through every policy; skipped, and said so, without one."""
    print()
    if not args.trace:
        print("trace replay: skipped (no --trace PATH given; a Mooncake-format JSONL trace)")
        return []
    limit = 2000 if args.trace_limit is None else args.trace_limit if args.trace_limit > 0 else None
    sessions = load_trace(args.trace, scale=args.trace_scale, limit=limit)
    print(f"trace replay: {sum(len(s.turns) for s in sessions)} requests in {len(sessions)} sessions, lengths x "
          f"{args.trace_scale}, arrival times as recorded")
    TABLE.header()
    rows = []
    for name in POLICIES:
        t0 = time.perf_counter()
        result = simulate(make_policy(name, args), Replay(sessions), config, seed=args.seed)
        row = {**result.summary(), "policy": name, "sessions": len(sessions), "wall_s": time.perf_counter() - t0}
        rows.append(row)
        show("trace", row)
    return rows


def plot(rows: list[dict[str, Any]], prefix: str, cost: str | None) -> None:
    """``PREFIX_ttft.png`` (median TTFT vs sessions) and ``PREFIX_hit.png`` (hit rate vs sessions)."""
    plt = pyplot()
    if plt is None:
        print("plots: skipped (matplotlib is not installed)")
        return

    for suffix, key, label in (("ttft", "median_ttft_s", "median TTFT (s)"), ("hit", "hit_rate", "cache hit rate")):
        fig, axes = plt.subplots(1, len(PRESETS), figsize=(5 * len(PRESETS), 4), squeeze=False)
        for ax, preset in zip(axes[0], PRESETS, strict=True):
            for name in POLICIES:
                pts = sorted((r["sessions"], r[key]) for r in rows if r["preset"] == preset and r["policy"] == name)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            ax.set_xscale("log", base=2)
            if suffix == "ttft":
                ax.set_yscale("log")
            ax.set_title(f"{preset} gaps")
            ax.set_xlabel("concurrent sessions")
            ax.set_ylabel(label)
        axes[0][0].legend(fontsize=8)
        fig.suptitle(f"SIMULATED, cost model {'fitted: ' + cost if cost else 'placeholder (uncalibrated)'}")
        fig.tight_layout()
        fig.savefig(f"{prefix}_{suffix}.png", dpi=120)
        plt.close(fig)
        print(f"plot: {prefix}_{suffix}.png")


def main() -> None:
    ap = parser(__doc__, "--sim: 16 and 64 sessions, shorter sessions, about a minute; --live: 8 and 16 sessions")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--sim", action="store_true", help="run the discrete-event simulator")
    mode.add_argument("--live", action="store_true", help="run on four live engine instances")
    mode.add_argument("--fit", default=None, metavar="LIVE_JSON",
                      help="fit the simulator's cost model to a --live run's JSON (write it with --cost-out)")
    mode.add_argument("--check", default=None, metavar="LIVE_JSON",
                      help="re-simulate a --live run's turns with --cost (else a model fitted to it) and compare TTFTs")
    ap.add_argument("--cost-out", default=None, help="with --fit: write the fitted cost model here")
    ap.add_argument("--plot", default=None, metavar="PREFIX", help="write PREFIX_ttft.png and PREFIX_hit.png")
    ap.add_argument("--cost", default=None, help="a fitted cost model (CostModel.to_dict JSON)")
    ap.add_argument("--scale", type=float, default=1 / 16, help="agent workload token scale (default 1/16)")
    ap.add_argument("--lifetimes", type=float, default=None,
                    help="run length in mean session lifetimes (default 4; --quick 3, --smoke 2)")
    rebalance_live.add_policy_arguments(ap)
    rebalance_live.add_live_arguments(ap)
    args = parse_args(ap)
    if args.lifetimes is None:
        args.lifetimes = pick(args, 4.0, 3.0, 2.0)
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "plot")}
    if args.fit:
        write_json(args.json, "rebalance", args.quick, mode="fit", source=args.fit, **fit_live(args.fit, args.cost_out))
        return
    if args.check:
        if args.cost:
            with open(args.cost) as f:
                cost = CostModel.from_dict(json.load(f))
        else:
            cost = CostModel.from_dict(fit_live(args.check, None)["model"])
        write_json(args.json, "rebalance", args.quick, mode="check", source=args.check, cost_model=cost.to_dict(),
                   **check_live(args.check, cost, make_policy))
        return
    if args.live:
        results = rebalance_live.run_live(args)
        if args.plot:
            rebalance_live.plot(results["rows"], f"{args.plot}_live.png")
        write_json(args.json, "rebalance", args.quick, arguments=settings, **results)  # results: mode, settings
        return
    results = run_sim(args)
    print(f"\nrebalancer: Rebalancer(interval_s={args.interval}, gap={args.gap}, max_moves_per_tick={args.max_moves}, "
          f"cooldown_s={args.cooldown}); cost model: {'from ' + args.cost if args.cost else 'placeholder defaults'}")
    if args.plot:
        plot(results["rows"], args.plot, args.cost)
    write_json(args.json, "rebalance", args.quick, mode="sim", settings=settings,
               cost_model=sim_config(args).cost.to_dict(), calibrated=bool(args.cost), **results)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
