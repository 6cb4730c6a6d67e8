"""Does the simulator reproduce a live run? Re-simulate its turns and compare TTFTs (``rebalance.py --check``).

Owns: ``check_live``. For every (policy, sessions, repeat) of a ``--live`` run's JSON, the same sessions
(``AgentWorkload`` with the live settings: the same token counts and shared prefixes) go through the same policy
class on a simulated cluster shaped like the live one: as many instances (4; 2 in a ``--smoke`` run), each serving
one request at a time, KV without a capacity limit (the live HF instances hold what they are given). Each turn
is issued when the live driver issued it (``Replay``; the rebalancer's period and cooldown are the live ones,
compressed in time as the live run was). Only the live run's last repeat is compared: the one ``--fit`` holds out
when it fits a run of several repeats (with one repeat, ``--fit`` holds out a random quarter of the turns instead,
and this compares them all). The simulator then decides everything else itself: queues, routing of first turns,
moves, cache hits, and each turn's cost from the cost model. Printed and returned per (policy, sessions): median
and p90 TTFT live and simulated, and the relative error of the simulated median; then the median of those errors.

Does not own: the cost model or its fit (``tensorcast.sim.cost``, ``rebalance.py --fit``), the policies' setup
(``make_policy``, passed in) or the live run (``rebalance_live.py``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from benchlib import Table
from live_driver import VOCAB
from tensorcast.sim import CostModel, Policy, Replay, SimConfig, simulate
from tensorcast.workloads import AgentWorkload, Session


def _sessions(work: AgentWorkload, rows: list[dict[str, Any]]) -> list[Session]:
    """The live run's sessions, each turn arriving when the live driver issued it (turns it never issued are
    left out)."""
    issued: dict[str, dict[int, float]] = {}
    for r in rows:
        issued.setdefault(r["session"], {})[r["turn"]] = r["issued_s"]
    out = []
    for sid, at in issued.items():
        drawn = work.session(int(sid.rsplit("-", 1)[1]))
        turns = tuple(dataclasses.replace(t, arrival_s=at[t.turn]) for t in drawn.turns if t.turn in at)
        out.append(Session(sid, turns))
    return out


def check_live(path: str, cost: CostModel, make_policy: Callable[[str, Any], Policy]) -> dict[str, Any]:
    with open(path) as f:
        live = json.load(f)
    s = live["settings"]
    ts = s["time_scale"]
    work = AgentWorkload(gaps=s["gaps"], mean_turns=s["mean_turns"], max_turns=s["max_turns"], scale=s["scale"],
                         vocab_size=VOCAB, seed=s["seed"])
    config = SimConfig(instances=s.get("instances", 4), max_batch=1, kv_capacity_tokens=1 << 22, block_tokens=16,
                       max_prefill_tokens=1 << 22, cost=cost, prefix_sharing=False, load_signal="sessions")
    rebalancer = RebalancerArgs(interval=s["interval_s"] * ts, gap=s["gap"], max_moves=s["max_moves"],
                               cooldown=s["cooldown_s"] * ts, seed=s["seed"], spill=s.get("spill"))
    points: dict[tuple[str, int], dict[str, list[float]]] = {}
    groups: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    held_out = max(r["repeat"] for r in live["calibration_samples"]["turns"])  # the repeat ``--fit`` leaves out
    for r in live["calibration_samples"]["turns"]:
        if r["repeat"] == held_out:
            groups.setdefault((r["policy"], r["sessions"], r["repeat"]), []).append(r)
    for (name, n, _repeat), rows in sorted(groups.items()):
        result = simulate(make_policy(name, rebalancer), Replay(_sessions(work, rows)), config, seed=s["seed"])
        point = points.setdefault((name, n), {"live": [], "sim": []})
        point["live"] += [r["ttft_s"] for r in rows]
        point["sim"] += [t.ttft_s for t in result.turns]
    print(f"simulator vs live run {path}, repeat {held_out} (the one a fit to this run holds out): the same sessions "
          f"and issue times")
    table = Table(("sess", ">5"), ("policy", "<18"), ("live med ms", ">11.1f"), ("sim med ms", ">10.1f"),
                  ("error", ">7.1%"), ("live p90 ms", ">11.1f"), ("sim p90 ms", ">10.1f"))
    table.header()
    out = []
    for (name, n), p in sorted(points.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        live_med, sim_med = float(np.median(p["live"])), float(np.median(p["sim"]))
        row: dict[str, Any] = {
            "policy": name, "sessions": n, "live_median_ttft_s": live_med, "sim_median_ttft_s": sim_med,
            "median_error": abs(sim_med - live_med) / live_med, "live_p90_ttft_s": float(np.percentile(p["live"], 90)),
            "sim_p90_ttft_s": float(np.percentile(p["sim"], 90)), "turns": len(p["live"])}
        out.append(row)
        table.row(n, name, live_med * 1e3, sim_med * 1e3, row["median_error"], row["live_p90_ttft_s"] * 1e3,
                  row["sim_p90_ttft_s"] * 1e3)
    errors = [float(r["median_error"]) for r in out]
    overall = float(np.median(errors)) if errors else math.nan
    print(f"median TTFT error over {len(out)} points: median {overall:.1%}, worst "
          f"{max(errors, default=math.nan):.1%} (the goal: < 15%)")
    return {"points": out, "median_error": overall}


@dataclasses.dataclass(frozen=True)
class RebalancerArgs:
    """What ``make_policy`` reads from the parsed arguments, taken from the live run's settings instead."""

    interval: float
    gap: int
    max_moves: int
    cooldown: float
    seed: int
    spill: int | None = None  # the live run's --spill (None: a run from before it existed, which never spilled)
