"""The harness every benchmark shares: its command line (``--quick``, ``--smoke``, ``--json``), best-of timing,
percentiles, sizes, the table it prints, the JSON it writes, and what its baselines' servers use (the raw-socket
receive loop, a free port).

``--quick`` is about a minute; ``--smoke`` is the smallest run that still takes every code path and writes
every row (seconds: ``benchmarks/smoke.py`` runs them all in CI), and implies ``--quick``. A benchmark sizes each
setting with ``pick(args, full, quick, smoke)``; where it waits for a worker's pre-faulted stock, ``--smoke``
shortens the wait (``SMOKE_STOCK``). Smoke figures say nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import socket
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tensorcast.pool.hugepages import shm_huge_pages
from tensorcast.pool.segments import SHM_DIR

# --smoke's cluster settings where a benchmark waits for the worker's pre-faulted stock to refill between runs: it
# starts refilling sooner after work, and the heartbeat that reports it comes sooner (seconds, not minutes, of
# waiting in all).
SMOKE_STOCK = {"worker.prefault_idle_seconds": "0.3", "worker.heartbeat_interval": "0.25"}


def parser(doc: str | None, quick: str = "about a minute") -> argparse.ArgumentParser:
    """The benchmark's argument parser with the options they all have; ``doc``'s first line describes it, and
    ``quick`` says what ``--quick`` runs. Parse with ``parse_args`` (below) so ``--smoke`` implies ``--quick``."""
    ap = argparse.ArgumentParser(description=doc.strip().splitlines()[0] if doc else None)
    ap.add_argument("--quick", action="store_true", help=f"a short run ({quick})")
    ap.add_argument("--smoke", action="store_true",
                    help="the smallest run through every path (seconds; figures meaningless); implies --quick")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON here")
    return ap


def parse_args(ap: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """``ap``'s arguments, with ``quick`` set under ``--smoke`` too (the JSON's ``quick`` says "not a full run")."""
    args = ap.parse_args(argv)
    args.quick = args.quick or args.smoke
    return args


def pick(args: argparse.Namespace, full: Any, quick: Any, smoke: Any) -> Any:
    """The setting for this run's size: ``smoke`` under --smoke, ``quick`` under --quick, else ``full``."""
    return smoke if args.smoke else quick if args.quick else full


class Table:
    """A fixed-width text table: each column a title and a format spec (``">12.4f"``, ``"<14"``), the header
    printed once with a rule under it. A cell that is None prints as ``-``; a string (a composite cell such as
    ``"0.91-1.02"``, or a blank) prints as it is, aligned in its column. Rows are flushed as they are printed
    (a long benchmark shows its progress)."""

    def __init__(self, *columns: tuple[str, str]) -> None:
        self.columns = columns
        self.widths = [_spec_width(spec, title) for title, spec in columns]

    def header(self) -> None:
        line = " ".join(f"{title:{_align(spec)}{w}}" for (title, spec), w in zip(self.columns, self.widths,
                                                                                     strict=True))
        print(line)
        print("-" * len(line), flush=True)

    def row(self, *values: Any) -> None:
        print(" ".join(self.cell(v, spec, w) for v, (_, spec), w in zip(values, self.columns, self.widths,
                                                                         strict=True)), flush=True)

    @staticmethod
    def cell(value: Any, spec: str, width: int) -> str:
        if value is None or isinstance(value, str):
            return f"{'-' if value is None else value:{_align(spec)}{width}}"
        text = f"{value:{spec}}"
        return text.ljust(width) if _align(spec) == "<" else text.rjust(width)


def _align(spec: str) -> str:
    return "<" if spec.startswith("<") else ">"


def _spec_width(spec: str, title: str) -> int:
    m = re.match(r"[<>^]?(\d+)", spec)
    return max(int(m.group(1)) if m else 0, len(title))


def read_exactly(read_into: Callable[[memoryview], int | None], view: memoryview) -> None:
    """Fill ``view`` by calls of ``read_into`` (a socket's ``recv_into``, an HTTP response's ``readinto``: no
    copy), however little each returns: the receive loop of the baselines' raw streams."""
    pos = 0
    while pos < len(view):
        n = read_into(view[pos:])
        if not n:
            raise ConnectionError(f"peer closed after {pos} of {len(view)} bytes")
        pos += n


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` (``read_exactly`` with its ``recv_into``)."""
    read_exactly(sock.recv_into, view)


def free_port() -> int:
    """A TCP port free on loopback now (for a baseline's server that must be told its port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values``."""
    return float(np.percentile(values, q))


def best_of(fn: Callable[[], object], reps: int) -> float:
    """Best wall time of ``reps`` calls of ``fn`` (which may return a time of its own, in seconds, instead)."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, out if isinstance(out, float) else time.perf_counter() - t0)
    return best


def fmt_size(n: int) -> str:
    return f"{n >> 30} GiB" if n >= 1 << 30 else f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def write_json(path: str | None, benchmark: str, quick: bool, **results: Any) -> None:
    """The benchmark's results as JSON at ``path`` (nothing when None), with the machine it ran on."""
    if path:
        with open(path, "w") as f:
            json.dump({"benchmark": benchmark, "quick": quick, "machine": platform.platform(),
                       "shm_huge": shm_huge_pages(SHM_DIR)[1], **results}, f, indent=2)


def shm_pages() -> str:
    """One line on the page size the pool's shared memory gets here (it sets the cost of every copy into it)."""
    huge, option = shm_huge_pages(SHM_DIR)
    return f"shared memory: {SHM_DIR} tmpfs huge={option} ({'2 MiB' if huge else '4 KiB'} pages)"


def metrics_switch(on: bool) -> dict[str, str]:
    """Turn metrics recording on or off in this process; returns the cluster configuration that does the same
    for the processes a benchmark starts."""
    from tensorcast.obs import metrics

    metrics.set_enabled(on)
    return {"metrics.enabled": "true" if on else "false"}


def mem_available() -> int:
    """Bytes the kernel says can be allocated without swapping (/proc/meminfo's MemAvailable); 0 if unknown."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def pyplot() -> Any:
    """matplotlib's pyplot drawing to files only (no display needed), or None when matplotlib is not installed
    (``pip install .[bench]``); callers then say the plot was skipped."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
