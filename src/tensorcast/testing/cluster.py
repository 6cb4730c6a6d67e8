"""Start a ``LocalCluster`` for a test and check it left nothing behind."""

from __future__ import annotations

import contextlib
import glob
import os
import time
from collections.abc import Iterator
from typing import Any

from tensorcast.cluster import LocalCluster
from tensorcast.pool.segments import SHM_DIR

__all__ = ["leaked_segments", "running_cluster", "wait_shards_settled"]


def leaked_segments(prefix: str) -> list[str]:
    return sorted(glob.glob(os.path.join(SHM_DIR, glob.escape(prefix) + "*")))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is not alive for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


@contextlib.contextmanager
def running_cluster(**kwargs: Any) -> Iterator[LocalCluster]:
    """A started cluster; on exit every process it ran is stopped and no segment may remain."""
    cluster = LocalCluster(**kwargs)
    pids: set[int] = set()
    try:
        cluster.start()
        yield cluster
    finally:
        pids.update(cluster.pids().values())
        cluster.stop()
    alive = [p for p in pids if _alive(p)]
    leaks = leaked_segments(cluster.shm_prefix)
    assert not alive, f"processes left running: {alive}"
    assert not leaks, f"shared-memory segments left behind: {leaks}"


def wait_shards_settled(client: Any, homes: set[str], timeout: float = 30.0) -> dict[int, tuple[str, int]]:
    """Wait until every KV shard is held, unexpired, by its HRW home among ``homes`` (leases move there
    within a few renewals after homes start or stop); returns ``{shard: (holder, fencing token)}``."""
    from tensorcast.kv.hrw import assignment

    deadline = time.monotonic() + timeout
    while True:
        table = client.list_shards()
        want = assignment(table.num_shards, homes)
        held = {lease.shard: (lease.holder, lease.token) for lease in table.leases
                if lease.holder == want[lease.shard] and lease.expiry > table.now}
        if len(held) == table.num_shards:
            return held
        if time.monotonic() > deadline:
            raise AssertionError(f"{table.num_shards - len(held)} shards not held by their HRW homes among "
                                 f"{sorted(homes)} after {timeout:g} s")
        time.sleep(0.1)
