"""The weight-sync benchmark's report (``benchmarks/weight_sync.py``).

Owns: what the updates are called (``KINDS``, ``LABELS``), the per-TP summary of the runs (medians and ranges of
time and CPU, the speed-ups over the default updater, delta/full), the table and the CPU breakdown it prints, the
goals' verdicts, and the figure. Does not own: running either system, the model or the JSON.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchlib import Table, pyplot
from default_updater import SYSTEMS_DEFAULT
from weight_sync_model import ratio, summarize

# TensorCast's updates: every tensor changed; 10% changed, found by the publisher's check; the same 10%, named by
# the caller (``publish(changed=...)``: a trainer that knows which parameters it trains, e.g. LoRA or frozen layers).
KINDS = ("full", "delta", "named")
LABELS = {"tensorcast_full": "TensorCast, full", "tensorcast_delta": "TensorCast, delta (10% of tensors)",
          "tensorcast_named": "TensorCast, delta, changed tensors named",
          "default_whole": "default updater, whole reads (page cache)",
          "default_sliced": "default updater, sliced reads (page cache)",
          "default_tcp": "default updater, whole files over TCP"}


def fmt(t: dict[str, float]) -> str:
    return f"{t['median']:7.3f} s [{t['min']:.3f}-{t['max']:.3f}]"


def fmt_ratio(r: dict[str, float] | None) -> str:
    return "   n/a" if r is None else f"{r['median']:5.2f}x [{r['min']:.2f}-{r['max']:.2f}]"


def summarize_tp(tp: int, r: dict[str, Any]) -> dict[str, Any]:
    """One TP's runs: time and CPU per system (median, range), speed-ups over the default updater, delta/full."""
    times = {f"tensorcast_{k}": summarize([x["seconds"] for x in r["tensorcast"][k]]) for k in KINDS}
    times.update({f"default_{k}": summarize([x["seconds"] for x in r["default"][k]]) for k in SYSTEMS_DEFAULT})
    cpu = {f"tensorcast_{k}": summarize([x["cpu_s"] for x in r["tensorcast"][k]]) for k in KINDS}
    cpu.update({f"default_{k}": summarize([x["cpu_s"] for x in r["default"][k]]) for k in SYSTEMS_DEFAULT})
    between = summarize([x["between_cpu_s"] for k in KINDS for x in r["tensorcast"][k]])
    ratios = {f"{a}_vs_{b}": ratio(times[b], times[a]) for a in times for b in times
              if a.startswith("tensorcast") and b.startswith("default")}
    full = times["tensorcast_full"]
    for kind in ("delta", "named"):
        part = times[f"tensorcast_{kind}"]
        ratios[f"{kind}_over_full"] = {"median": part["median"] / full["median"],
                                       "min": part["min"] / full["max"], "max": part["max"] / full["min"]}
    return {"tp": tp, "times": times, "ratios": ratios, "cpu_s": cpu, "tensorcast_between_cpu_s": between}


def report(results: dict[int, dict[str, Any]], reps: int, ckpt: dict[str, Any], model_desc: str, total: int,
           delta_bytes: int, netns: bool, plot_path: str | None) -> tuple[list[dict[str, Any]], dict[str, Any],
                                                                          str | None]:
    """Print the table, the CPU breakdown and the goals; draw the figure at ``plot_path``. Returns the summary
    (one entry per TP), the goals and the plot's note (why there is none) for the JSON."""
    summary = [summarize_tp(tp, r) for tp, r in results.items()]
    print(f"\nTime per update, from publish/save until every rank holds the new version; {model_desc}; "
          f"median [range] of {reps}. Speed-up = the default updater's time / this one's (above 1: faster).")
    table = Table(("TP", ">3"), ("system", "<44"), ("seconds per update", ">26"), ("vs default (whole)", ">22"),
                  ("vs default (TCP)", ">22"), ("CPU s", ">8.2f"), ("of full", ">8"))
    table.header()
    for s in summary:
        times, ratios = s["times"], s["ratios"]
        for key, label in LABELS.items():
            vs = [fmt_ratio(ratios.get(f"{key}_vs_{b}")) if key.startswith("tensorcast") else
                  fmt_ratio(ratio(times[b], times[key])) for b in ("default_whole", "default_tcp")]
            kind = key.removeprefix("tensorcast_")
            part = f"{ratios[f'{kind}_over_full']['median']:.1%}" if kind in ("delta", "named") else ""
            table.row(s["tp"], label, fmt(times[key]), vs[0], vs[1], s["cpu_s"][key]["median"], part)
        table.row(s["tp"], f"checkpoint-engine {ckpt.get('version', '')}",
                  "runs" if ckpt["runs"] else "did not run (see below)", "", "", "", "")
    cpu_by_process(results)
    print("The default updater has no delta path (it rewrites and rereads everything): its delta time is its full "
          "time.\nCPU s: user + system CPU seconds of every process involved during the update (median); TensorCast's "
          "workers also re-fault their stock between updates, untimed: "
          + ", ".join(f"TP={x['tp']} {x['tensorcast_between_cpu_s']['median']:.2f}" for x in summary) + " CPU s.")
    print(f"checkpoint-engine {ckpt.get('version', '')}: {'runs' if ckpt['runs'] else 'error: ' + ckpt['error']}"
          + (f" ({ckpt['where']})" if ckpt.get("where") else ""))
    met = goals(summary, delta_bytes / total)
    title = (f"Weight sync, {model_desc}\nhost A trainer -> host B TP engine "
             f"({'netns' if netns else 'loopback TCP'}), 2 vCPU, no GPU")
    foot = "labels: speed-up over the default updater (whole reads); checkpoint-engine: " + (
        "runs" if ckpt["runs"] else f"did not run ({ckpt['error'][:60]})")
    note = plot(plot_path, summary, title, foot) if plot_path else None
    if note:
        print(note)
    return summary, met, note


def cpu_by_process(results: dict[int, dict[str, Any]]) -> None:
    """Where TensorCast's CPU goes, against the default updater's (medians per process role)."""
    for tp, r in results.items():
        parts = []
        for label, rows in (("TensorCast full", r["tensorcast"]["full"]), ("delta", r["tensorcast"]["delta"]),
                            ("default whole", r["default"]["whole"]), ("default TCP", r["default"]["tcp"])):
            roles = sorted({k for x in rows for k in x["cpu_by"]})
            parts.append(f"{label} " + " ".join(
                f"{k} {statistics.median(x['cpu_by'].get(k, 0.0) for x in rows):.2f}" for k in roles))
        print(f"CPU s by process, TP={tp} (medians): " + "; ".join(parts))


def goals(summary: list[dict[str, Any]], delta_share: float) -> dict[str, Any]:
    """The goals' verdicts (printed): >= 2.63x the default updater at TP=4 (when run), a delta update ~10% of a
    full one (``delta_share``: the share of the bytes a delta changes)."""
    out: dict[str, Any] = {}
    s4: dict[str, Any] = next((x["ratios"] for x in summary if x["tp"] == 4), {})
    for base in ("default_whole", "default_tcp") if s4 else ():
        r4 = s4[f"tensorcast_full_vs_{base}"]
        out[f"tp4_full_vs_{base}_ge_2.63x"] = {**r4, "met": r4["median"] >= 2.63}
        print(f"goal: TensorCast >= 2.63x the default updater ({LABELS[base].split(', ', 1)[1]}) at TP=4, full "
              f"update: {fmt_ratio(r4).strip()} -> {'met' if r4['median'] >= 2.63 else 'not met'}")
    for kind, how in (("delta", "found by the publisher's check"), ("named", "named by the caller")):
        worst = max(x["ratios"][f"{kind}_over_full"]["median"] for x in summary)
        out[f"{kind}_about_10pct_of_full"] = {"worst_tp_median": worst, "met": worst <= 0.15}
        print(f"goal: a delta update ~10% of a full one ({delta_share:.1%} of the bytes change, {how}; met "
              f"when <= 15%): worst TP {worst:.1%} -> {'met' if worst <= 0.15 else 'not met'}")
    return out


def plot(path: str, summary: list[dict[str, Any]], title: str, footnote: str) -> str | None:
    plt = pyplot()
    if plt is None:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    colors = {"tensorcast_full": "C0", "tensorcast_delta": "C9", "tensorcast_named": "C2", "default_whole": "0.25",
              "default_sliced": "0.55", "default_tcp": "0.8"}
    series = [(k, label, colors[k]) for k, label in LABELS.items()]
    fig, ax = plt.subplots(figsize=(9, 5.5))
    width = 0.8 / len(series)
    for k, (key, label, color) in enumerate(series):
        xs, ys, lo, hi = [], [], [], []
        for i, s in enumerate(summary):
            if key in s["times"]:
                t = s["times"][key]
                xs.append(i + (k - (len(series) - 1) / 2) * width)
                ys.append(t["median"])
                lo.append(t["median"] - t["min"])
                hi.append(t["max"] - t["median"])
        bars = ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=label, color=color)
        if key.startswith("tensorcast"):
            for b, s in zip(bars, [s for s in summary if key in s["times"]], strict=True):
                r = s["ratios"].get(f"{key}_vs_default_whole")
                if r:
                    ax.annotate(f"{r['median']:.2f}x", (b.get_x() + b.get_width() / 2, b.get_height()),
                                ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(summary)), [f"TP={s['tp']}" for s in summary])
    ax.set_ylabel("seconds per update (median; bar: range)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3)
    ax.grid(True, axis="y", alpha=0.3)
    fig.text(0.01, 0.01, footnote, fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=120)
    return None
