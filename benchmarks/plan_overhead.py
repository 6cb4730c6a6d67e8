"""Plan overhead: no-op-sized steps in one plan vs the same operations issued one by one, and signal rates.

Steps are prefetches of an artifact already present on the target (a no-op on the worker), so the time
measured is the machinery: plan validation and scheduling on the gateway vs one caller round trip each.
Also: list_workers() and list_instances() calls per second from one caller (a router polling signals).

``--smoke``: plans of 1 and 10 steps, once each, and 20 polls (figures meaningless; every row).

Usage: python benchmarks/plan_overhead.py [--quick | --smoke] [--json PATH]
"""

from __future__ import annotations

import time

import numpy as np

import tensorcast as tc
from benchlib import Table, parse_args, parser, pick, write_json


def main() -> None:
    args = parse_args(parser(__doc__))
    step_counts = pick(args, [1, 10, 50, 200], [1, 10, 50], [1, 10])
    reps = pick(args, 5, 3, 1)
    polls = pick(args, 2000, 300, 20)
    rows = []
    with tc.LocalCluster(workers=2) as cluster, tc.connect(cluster.address) as client:
        cluster.start_instance("inst-a", "w0", ["--seed", "0"])
        art = client.put(np.arange(1024), on="w0")
        art.prefetch(to="w1").result(timeout=30)
        table = Table(("steps", ">6"), ("one-by-one ms", ">14.2f"), ("plan k=1 ms", ">12.2f"),
                      ("plan k=8 ms", ">12.2f"), ("per step (plan k=8) ms", ">23.3f"))
        table.header()
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
            table.row(n, t_seq * 1e3, t_p1 * 1e3, t_p8 * 1e3, t_p8 / n * 1e3)

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
