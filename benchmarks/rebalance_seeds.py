"""The TensorCast rebalancer against the best baseline over workloads it was not tuned on: the simulator's preset
grid (``rebalance.py --sim``) under several seeds, and a Mooncake-format trace cut into windows of requests.

For every cell (preset x concurrent sessions, or one trace window) and every seed, all of ``rebalance.POLICIES``
run in the simulator with the same workload; the figure is the ratio of the ``tensorcast`` policy's median TTFT
to the lowest median TTFT of the baselines in that run (``power-of-two``, ``cache-aware``, ``load-aware+shared``,
``sticky+shared``): below 1 the rebalancer wins, 1 is a tie. Per cell: the ratio's min, median and max over the
seeds (or windows), how many runs it was within 2% of the best or better, and the ratio to load-aware+shared
alone. The seeds draw the agent sessions (their lengths, gaps and start times); the trace windows are
consecutive slices of ``--trace-limit`` requests (each replayed from its own first arrival), none of them the
ones the settings were chosen on when ``--first-seed`` is past them.

Placeholder cost model (``CostModel()``) unless ``--cost`` gives a fitted one, as in ``rebalance.py``.

``--smoke``: two seeds, 4 and 8 sessions, short sessions, two windows of the trace if one is given.

Usage: python benchmarks/rebalance_seeds.py [--quick | --smoke] [--json PATH] [--seeds N] [--first-seed S]
       [--trace PATH] [--trace-limit N] [--cost PATH] [--scale S]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import rebalance
import rebalance_live
from benchlib import Table, parse_args, parser, pick, write_json
from tensorcast.sim import Replay, simulate
from tensorcast.workloads.trace import read_trace, replay

OURS = "tensorcast"
BASELINES = tuple(p for p in rebalance.POLICIES if p not in rebalance.OURS)
WITHIN = 1.02  # a ratio up to this counts as a tie with the best baseline


def _ratios(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """(ours / best baseline, ours / load-aware+shared) of one run's rows."""
    by = {r["policy"]: r["median_ttft_s"] for r in rows}
    return by[OURS] / min(by[p] for p in BASELINES), by[OURS] / by[rebalance.BASELINE]


def grid(args: argparse.Namespace, seeds: list[int]) -> list[dict[str, Any]]:
    """Every preset x session count x seed: each policy's row, and the cell's ratios."""
    config = rebalance.sim_config(args)
    counts = pick(args, rebalance.SESSIONS, rebalance.QUICK_SESSIONS, rebalance.SMOKE_SESSIONS)
    out = []
    for preset in rebalance.PRESETS:
        for n in counts:
            for seed in seeds:
                args.seed = seed
                wl = rebalance.workload(preset, args)
                rows = [rebalance.run_point(name, wl, n, config, args) for name in rebalance.POLICIES]
                best, vs_la = _ratios(rows)
                out.append({"cell": f"{preset} {n}", "seed": seed, "vs_best": best, "vs_load_aware": vs_la,
                            "rows": rows})
    return out


def windows(args: argparse.Namespace, count: int) -> list[dict[str, Any]]:
    """Consecutive windows of ``--trace-limit`` requests of the trace, each replayed through every policy."""
    if not args.trace:
        return []
    records = sorted(read_trace(args.trace), key=lambda r: r.timestamp_ms)
    size = args.trace_limit or 2000
    config = rebalance.sim_config(args)
    out = []
    for k in range(min(count, len(records) // size)):
        sessions = replay(records[k * size : (k + 1) * size], scale=args.trace_scale)
        rows = []
        for name in rebalance.POLICIES:
            result = simulate(rebalance.make_policy(name, args), Replay(sessions), config, seed=args.seed)
            rows.append({**result.summary(), "policy": name, "sessions": len(sessions)})
        best, vs_la = _ratios(rows)
        out.append({"cell": "trace", "seed": k, "vs_best": best, "vs_load_aware": vs_la, "rows": rows})
    return out


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    table = Table(("cell", "<12"), ("runs", ">5"), ("ours/best min", ">14.3f"), ("median", ">7.3f"),
                  ("max", ">7.3f"), ("within 2%", ">10"), ("ours/load-aware median", ">23.3f"))
    table.header()
    cells = []
    for cell in dict.fromkeys(r["cell"] for r in runs):
        at = [r for r in runs if r["cell"] == cell]
        best = [r["vs_best"] for r in at]
        row = {"cell": cell, "runs": len(at), "min": min(best), "median": statistics.median(best), "max": max(best),
               "within": sum(b <= WITHIN for b in best),
               "vs_load_aware_median": statistics.median(r["vs_load_aware"] for r in at)}
        cells.append(row)
        table.row(cell, row["runs"], row["min"], row["median"], row["max"], f"{row['within']}/{len(at)}",
                  row["vs_load_aware_median"])
    return cells


def main() -> None:
    ap = parser(__doc__, "the quick grid (16 and 64 sessions) under 5 seeds, 5 trace windows; about a minute")
    ap.add_argument("--seeds", type=int, default=None, help="seeds (and trace windows) per cell (default 10; "
                                                             "quick 5, smoke 2)")
    ap.add_argument("--first-seed", type=int, default=100, help="the first seed (default 100)")
    ap.add_argument("--cost", default=None, help="a fitted cost model (CostModel.to_dict JSON)")
    ap.add_argument("--scale", type=float, default=1 / 16, help="agent workload token scale (default 1/16)")
    ap.add_argument("--lifetimes", type=float, default=None, help="run length in mean session lifetimes")
    rebalance_live.add_policy_arguments(ap)
    args = parse_args(ap)
    if args.lifetimes is None:
        args.lifetimes = pick(args, 4.0, 3.0, 2.0)
    count = args.seeds or pick(args, 10, 5, 2)
    seeds = list(range(args.first_seed, args.first_seed + count))
    t0 = time.perf_counter()
    runs = grid(args, seeds) + windows(args, count)
    cells = summarize(runs)
    wins = sum(c["within"] for c in cells)
    total = sum(c["runs"] for c in cells)
    print(f"\ntensorcast within 2% of the best baseline or better in {wins} of {total} runs; "
          f"{time.perf_counter() - t0:.0f} s")
    write_json(args.json, "rebalance_seeds", args.quick, seeds=seeds, cells=cells, runs=runs)


if __name__ == "__main__":
    main()
