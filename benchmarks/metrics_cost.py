"""What metrics cost: put/get (benchmarks/put_get.py) and KV pages (benchmarks/kv_pages.py) with metrics
recording on and off, alternating in one run so that drift of the machine hits both alike.

Each round measures every case once with metrics on and once off (the order flips each round); the table
gives, per case, the median over rounds of on/off throughput and its range. Goal: within 3% (0.97-1.03).
On a small shared host those ratios swing by more than the effect measured, so the run also gives the
deterministic part: what recording costs per request (both ends, timed over many calls) as a share of the
smallest request's round trip measured in the same run (a one-key KV exists).

``--smoke``: one round (metrics on, then off) of 4 KiB and 1 MiB puts and gets and 32 KV pages, a small worker
stock, one call timed (figures meaningless).

Usage: python benchmarks/metrics_cost.py [--quick | --smoke] [--json PATH]
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from benchlib import Table, parse_args, parser, pick, write_json
from kv_pages import bench_tensorcast
from put_get import SMOKE_CONFIG, measure

KiB, MiB = 1 << 10, 1 << 20


def one_round(on: bool, sizes: list[int], pages: int, smoke: bool = False) -> dict[str, float]:
    """Throughputs (higher is better) of every case, metrics ``on`` or off."""
    out: dict[str, float] = {}
    for r in measure(sizes, on, 1, SMOKE_CONFIG) if smoke else measure(sizes, on):
        size = r["size"]
        label = f"{int(size) // KiB} KiB" if size < MiB else f"{int(size) // MiB} MiB"
        out[f"put shm {label}"] = 1 / r["put_local_s"]
        out[f"put tcp {label}"] = 1 / r["put_remote_s"]
        out[f"get shm {label}"] = 1 / r["get_local_s"]
        out[f"get tcp {label}"] = 1 / r["get_remote_s"]
    kv = bench_tensorcast(1, 64 * KiB, pages, 1 if smoke else 3, "shard-homes", on)
    out["_rtt_ms"] = kv["index_rtt_ms"]
    out["kv put 64 KiB pages"] = kv["put_pages_s"]
    out["kv get 64 KiB pages"] = kv["get_pages_s"]
    out["kv exists"] = kv["exists_keys_s"]
    return out


def main() -> None:
    args = parse_args(parser(__doc__, "two rounds of small cases, about a minute"))
    rounds = pick(args, 5, 2, 1)
    sizes = pick(args, [4 * KiB, 1 * MiB, 16 * MiB, 64 * MiB], [4 * KiB, 1 * MiB, 16 * MiB], [4 * KiB, 1 * MiB])
    pages = pick(args, 1024, 256, 32)
    ratios: dict[str, list[float]] = {}
    rtts: list[float] = []
    for i in range(rounds):
        order = (True, False) if i % 2 == 0 else (False, True)
        results = {on: one_round(on, sizes, pages, args.smoke) for on in order}
        rtts.append(results[True].pop("_rtt_ms"))
        results[False].pop("_rtt_ms")
        for case, on_value in results[True].items():
            ratios.setdefault(case, []).append(on_value / results[False][case])
    rows: list[dict[str, Any]] = []
    table = Table(("case", "<24"), ("on/off (median)", ">16.3f"), ("range", ">15"))
    table.header()
    for case, rs in ratios.items():
        med = statistics.median(rs)
        rows.append({"case": case, "on_over_off_median": med, "min": min(rs), "max": max(rs), "rounds": rs})
        table.row(case, med, f"{min(rs):>7.3f}-{max(rs):<7.3f}")
    meds = [r["on_over_off_median"] for r in rows]
    print(f"\nmedian over cases {statistics.median(meds):.3f}; worst case {min(meds):.3f} (goal: within 0.97-1.03)")
    per_request = recording_cost_us(pick(args, 200_000, 200_000, 20_000))
    rtt_us = statistics.median(rtts) * 1e3
    print(f"recording per request, both ends: {per_request:.2f} us = {100 * per_request / rtt_us:.2f}% of the "
          f"smallest request's round trip here ({rtt_us:.0f} us)")
    write_json(args.json, "metrics_cost", args.quick, rounds=rounds, rows=rows, recording_us=per_request,
               rtt_us=rtt_us)


def recording_cost_us(n: int = 200_000) -> float:
    """Microseconds of metric recording (and the no-op span check) one request costs, server plus client."""
    from tensorcast.obs import metrics, tracing

    metrics.set_enabled(True)
    t0 = time.perf_counter()
    for _ in range(n):
        with tracing.span("x", "0123456789abcdef", 0, "server"):
            metrics.rpc_served("KVExists", "ok", 0.0001)
        with tracing.span("x", "0123456789abcdef", kind="client"):
            metrics.rpc_sent("KVExists", "worker", "ok", 0.0001)
    return (time.perf_counter() - t0) / n * 1e6


if __name__ == "__main__":
    main()
