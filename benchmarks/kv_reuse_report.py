"""``benchmarks/kv_reuse.py``'s report: each system's TTFT per (N, L) over its samples, TensorCast's ratios to the
baselines of the same run, the goals' verdicts, the table and the figure.

Owns: ``summarize`` (a sample: one prefill, or one repetition's mean over the instances that ran at once; per
system the best, median and worst sample), ``goals``, ``report`` (what the run prints at its end) and ``plot``.
Does not own: running the engines or the JSON.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchlib import Table, pyplot


def summarize(rows: list[dict[str, Any]], instances: list[int], lengths: list[int]) -> list[dict[str, Any]]:
    """Per N and L: each system's TTFT (over its samples the best, the median and the worst) and TensorCast's
    ratios to the baselines of the same run, from the best samples (as ``benchlib.best_of``: the least
    disturbed on a shared, noisy host) and from the medians."""
    def stat(system: str, n: int, length: int, key: str) -> dict[str, float] | None:
        # A sample: one prefill, or one repetition's mean over the instances that ran at once.
        vals = [statistics.fmean(rep) for r in rows if r["system"] == system and r["n"] == n
                and r["length"] == length and key in r for rep in (r[key] if isinstance(r[key], list) else [[r[key]]])]
        if not vals:
            return None
        return {"best": min(vals), "median": statistics.median(vals), "max": max(vals), "samples": len(vals)}

    out = []
    for n in instances:
        for length in lengths:
            s: dict[str, Any] = {"n": n, "length": length, "ttft": {}}
            for name, (system, key) in {"recompute_alone": ("tensorcast", "prefill_ttft"),
                                        "recompute": ("tensorcast", "recompute_ttft"),
                                        "local_hit": ("tensorcast", "local_hit_ttft"),
                                        "tensorcast": ("tensorcast", "reuse_ttft"),
                                        "mooncake": ("mooncake", "reuse_ttft"),
                                        "lmcache": ("lmcache", "reuse_ttft")}.items():
                v = stat(system, n, length, key)
                if v is not None:
                    s["ttft"][name] = v
            for which in ("best", "median"):
                t = {k: v[which] for k, v in s["ttft"].items()}
                if "tensorcast" not in t:
                    continue
                tc, ratios = t["tensorcast"], {}
                if "recompute" in t:
                    ratios["reduction_vs_recompute"] = 1 - tc / t["recompute"]
                if "recompute_alone" in t:
                    ratios["reduction_vs_recompute_alone"] = 1 - tc / t["recompute_alone"]
                if "mooncake" in t:
                    ratios["tensorcast_over_mooncake"] = tc / t["mooncake"]
                if "local_hit" in t:
                    ratios["tensorcast_over_local_hit"] = tc / t["local_hit"]
                s[which] = ratios
            out.append(s)
    return out


def print_table(summary: list[dict[str, Any]]) -> None:
    cols = ["recompute_alone", "recompute", "local_hit", "tensorcast", "mooncake", "lmcache"]
    ratios = [("TC cut", "reduction_vs_recompute", _pct), ("TC cut(alone)", "reduction_vs_recompute_alone", _pct),
              ("TC/mooncake", "tensorcast_over_mooncake", _x), ("TC/local hit", "tensorcast_over_local_hit", _x)]
    print("\nTTFT, seconds: best sample (median sample); a sample is one prefill, or the mean over the instances"
          "\nthat ran at once in one repetition; ratios from the best (from the medians)")
    table = Table(("N", ">2"), ("tokens", ">6"), *((c, ">16") for c in cols), *((name, ">15") for name, _, _ in ratios))
    table.header()
    for s in summary:
        ttfts = [f"{v['best']:>7.3f} ({v['median']:>6.3f})" if (v := s["ttft"].get(c)) else None for c in cols]
        rs = [f"{fmt(s.get('best', {}).get(key))} ({fmt(s.get('median', {}).get(key))})" for _, key, fmt in ratios]
        table.row(s["n"], s["length"], *ttfts, *rs)


def report(rows: list[dict[str, Any]], status: dict[str, Any], instances: list[int], lengths: list[int],
           plot_path: str | None) -> tuple[list[dict[str, Any]], dict[str, Any], str | None]:
    """What the run prints at its end (the table, the OffloadingConnector's runs, the goals, each system's
    outcome) and the figure at ``plot_path``; returns the summary, the goals and the plot's note for the JSON."""
    summary = summarize(rows, instances, lengths)
    print_table(summary)
    for r in rows:
        if r["system"] == "offloading":
            print(f"offloading, 1 instance, {r['length']} tokens: first {r['prefill_ttft']:.3f}s, same prefix again "
                  f"{r['reuse_ttft'][0][0]:.3f}s ({r['reuse_cached'][0][0]} tokens from its store)")
    met = {which: goals(summary, instances, lengths, which) for which in ("best", "median")}
    print("\nGoals (TensorCast; from the best-of values, then from the medians):")
    for label, g in [(f"{n} {w}", g) for w in met for n, g in met[w].items()]:
        print(f"  {label}: reduction at {max(lengths)} tokens {_pct(g['reduction_at_longest'])} vs recompute at the "
              f"same concurrency ({_pct(g['reduction_at_longest_vs_alone'])} vs alone; goal >= 87.5%): "
              f"{_met(g['reduction_at_longest_ge_87.5pct'])}; no worse than Mooncake at every length (worst "
              f"{_x(g['worst_over_mooncake'])}): {_met(g['no_worse_than_mooncake_every_length'])}; within 1.5x of the "
              f"local hit (worst {_x(g['worst_over_local_hit'])}): {_met(g['within_1.5x_local_hit'])}")
    print("\nSystems:")
    for name, st in status.items():
        print(f"  {name}: {st}")
    matches = [r["first_token_match"] for r in rows if r["system"] != "offloading"]
    print(f"first token after reuse equals the prefill's: {sum(matches)}/{len(matches)}")
    note = plot(plot_path, summary, instances) if plot_path else None
    if note:
        print(note)
    return summary, met, note


def goals(summary: list[dict[str, Any]], instances: list[int], lengths: list[int], which: str) -> dict[str, Any]:
    """The three goals, per N, from this run's ``which`` ("best" or "median") values (met: True/False; None:
    not measured)."""
    out: dict[str, Any] = {}
    for n in instances:
        rows = [s.get(which, {}) for s in summary if s["n"] == n]
        longest: dict[str, Any] = next(
            (s.get(which, {}) for s in summary if s["n"] == n and s["length"] == max(lengths)), {})
        red = longest.get("reduction_vs_recompute")
        mc = [s.get("tensorcast_over_mooncake") for s in rows]
        lh = [s.get("tensorcast_over_local_hit") for s in rows]
        out[f"N={n}"] = {
            "reduction_at_longest_ge_87.5pct": None if red is None else red >= 0.875,
            "reduction_at_longest": red,
            "reduction_at_longest_vs_alone": longest.get("reduction_vs_recompute_alone"),
            "no_worse_than_mooncake_every_length": None if None in mc or not mc else all(r <= 1.0 for r in mc),
            "worst_over_mooncake": None if None in mc or not mc else max(mc),
            "within_1.5x_local_hit": None if None in lh or not lh else all(r <= 1.5 for r in lh),
            "worst_over_local_hit": None if None in lh or not lh else max(lh)}
    return out


def plot(path: str, summary: list[dict[str, Any]], instances: list[int]) -> str | None:
    plt = pyplot()
    if plt is None:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    fig, axes = plt.subplots(1, len(instances), figsize=(6 * len(instances), 4.5), squeeze=False)
    styles = {"recompute": ("recompute (same concurrency)", "k", "o"), "recompute_alone": ("recompute alone", "0.5",
              "o"), "local_hit": ("own prefix-cache hit (limit)", "g", "s"), "tensorcast": ("TensorCast", "C0", "D"),
              "mooncake": ("Mooncake Store connector", "C1", "^"), "lmcache": ("LMCache connector", "C3", "v")}
    for ax, n in zip(axes[0], instances, strict=True):
        rows = [s for s in summary if s["n"] == n]
        for key, (label, color, marker) in styles.items():
            pts = [(s["length"], s["ttft"][key]) for s in rows if key in s["ttft"]]
            if not pts:
                continue
            xs = [p[0] for p in pts]
            best = [p[1]["best"] for p in pts]
            worst = [p[1]["max"] - b for b, p in zip(best, pts, strict=True)]
            ax.errorbar(xs, best, yerr=[[0.0] * len(best), worst], label=label, color=color, marker=marker,
                        capsize=3)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks([s["length"] for s in rows], [str(s["length"]) for s in rows])
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("TTFT (s): best sample, bar to the worst")
        ax.set_title(f"{n} vLLM CPU instances: 1 prefills, {n - 1} reuse at once")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return None


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _met(v: bool | None) -> str:
    return "not measured" if v is None else "met" if v else "NOT met"
