"""Plan overhead: no-op-sized steps in one plan vs the same operations issued one by one, and signal rates.

Steps are prefetches of an artifact already present on the target (a no-op on the worker), so the time
measured is the machinery: plan validation and scheduling on the gateway vs one caller round trip each.
Also: list_workers() and list_instances() calls per second from one caller (a router polling signals).

Usage: python benchmarks/plan_overhead.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import tensorcast as tc
from benchlib import write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    step_counts = [1, 10, 50] if args.quick else [1, 10, 50, 200]
    reps = 3 if args.quick else 5
    polls = 300 if args.quick else 2000
    rows = []
    with tc.LocalCluster(workers=2) as cluster, tc.connect(cluster.address) as client:
        cluster.start_instance("inst-a", "w0", ["--seed", "0"])
        art = client.put(np.arange(1024), on="w0")
        art.prefetch(to="w1").result(timeout=30)
        print(f"{'steps':>6} {'one-by-one ms':>14} {'plan k=1 ms':>12} {'plan k=8 ms':>12} "
              f"{'per step (plan k=8) ms':>23}")
        for n in step_counts:
            def one_by_one(n: int = n) -> float:
                t0 = time.perf_counter()
                for i in range(n):
                    art.prefetch(to="w1" if i % 2 else "w0").result(timeout=30)
                return time.perf_counter() - t0

            def planned(k: int, n: int = n) -> float:
                plan = client.plan(ctx=tc.context(timeout=60))
                for i in range(n):
                    plan.prefetch(art, to="w1" if i % 2 else "w0")
                t0 = time.perf_counter()
                assert plan.run(concurrency=k).result(timeout=60).ok
                return time.perf_counter() - t0

            t_seq = min(one_by_one() for _ in range(reps))
            t_p1 = min(planned(1) for _ in range(reps))
            t_p8 = min(planned(8) for _ in range(reps))
            rows.append({"steps": n, "one_by_one_s": t_seq, "plan_k1_s": t_p1, "plan_k8_s": t_p8,
                         "plan_k8_per_step_s": t_p8 / n, "speedup_k8": t_seq / t_p8})
            print(f"{n:>6} {t_seq * 1e3:>14.2f} {t_p1 * 1e3:>12.2f} {t_p8 * 1e3:>12.2f} {t_p8 / n * 1e3:>23.3f}")

        signals = {}
        for name, fn in (("list_workers", client.list_workers), ("list_instances", client.list_instances)):
            fn()
            t0 = time.perf_counter()
            for _ in range(polls):
                fn()
            rate = polls / (time.perf_counter() - t0)
            signals[name] = rate
            print(f"{name}: {rate:,.0f} calls/s ({1e3 / rate:.2f} ms each; a 100 ms poll costs "
                  f"{100 / rate * 1e1:.2f}% of one caller thread)")
    write_json(args.json, "plan_overhead", args.quick, rows=rows, signals_per_s=signals)


if __name__ == "__main__":
    main()
