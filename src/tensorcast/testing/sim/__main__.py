"""Run many seeds of the simulated cluster and print the ones that fail (each replays exactly).

Usage: python -m tensorcast.testing.sim [--seeds A-B | --seed N] [--log PATH] [--json PATH]

Python's hash seed decides the iteration order of sets of strings, and so the order of messages: the runner
fixes it (``PYTHONHASHSEED=0``, re-executing itself when it is not set), so a failing seed fails the same way
every time. ``--seed N --log PATH`` replays one with every role's log, stamped with virtual time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from tensorcast.testing.sim.checker import InvariantBroken
from tensorcast.testing.sim.scenario import run_seed


def _seeds(spec: str) -> range:
    first, _, last = spec.partition("-")
    return range(int(first), int(last or first) + 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0-199", help="a range A-B of seeds (default 0-199)")
    ap.add_argument("--seed", type=int, default=None, help="one seed (replays it)")
    ap.add_argument("--log", default=None, help="with --seed: the roles' logs, stamped with virtual time")
    ap.add_argument("--json", default=None, help="write the outcome of every seed here")
    ap.add_argument("--fault-seconds", type=float, default=30.0, help="virtual seconds of faults per seed")
    args = ap.parse_args()
    if os.environ.get("PYTHONHASHSEED") != "0":
        os.execve(sys.executable, [sys.executable, "-m", "tensorcast.testing.sim", *sys.argv[1:]],
                  {**os.environ, "PYTHONHASHSEED": "0"})
    seeds = range(args.seed, args.seed + 1) if args.seed is not None else _seeds(args.seeds)
    started = time.perf_counter()
    failed: list[int] = []
    rows: list[dict[str, Any]] = []
    for seed in seeds:
        try:
            out = run_seed(seed, fault_seconds=args.fault_seconds, log_path=args.log if args.seed is not None else None)
            rows.append({"seed": seed, "ok": True, "acked": out.acked, "at_risk": out.at_risk,
                         "artifacts": out.artifacts, "checks": out.checks,
                         "virtual_seconds": round(out.virtual_seconds, 3), "replicas": out.replicas,
                         "faults": out.faults})
        except InvariantBroken as exc:
            failed.append(seed)
            rows.append({"seed": seed, "ok": False, "error": str(exc)})
            print(f"FAILED {exc}\n  replay: python -m tensorcast.testing.sim --seed {seed} --log sim-{seed}.log\n")
    took = time.perf_counter() - started
    checks = sum(int(r.get("checks", 0)) for r in rows)
    print(f"{len(rows) - len(failed)} of {len(rows)} seeds passed in {took:.1f} s "
          f"({checks} invariant checks); failed: {failed or 'none'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seeds": rows, "failed": failed, "seconds": took}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
