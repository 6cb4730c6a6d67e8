"""Helpers shared by the benchmarks: best-of timing, sizes, and the JSON every benchmark writes."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from typing import Any

from tensorcast.pool.hugepages import shm_huge_pages
from tensorcast.pool.segments import SHM_DIR


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
