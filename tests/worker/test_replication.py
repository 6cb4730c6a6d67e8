"""A placement's copies with real worker processes: an ``ha`` put has its two copies on live workers when it
returns (a worker killed a moment before included), says so when fewer live workers exist, and a worker's loss
(kill -9, or a restart that lost its memory) is repaired: the copies are made again on live workers, and the
global store's ``tensorcast_replicas_missing`` and ``tensorcast status`` go back to 0."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable
from typing import TypeVar

import numpy as np

import tensorcast as tc
from tensorcast.cli.status import cluster_state
from tensorcast.cluster import LocalCluster
from tensorcast.testing import running_cluster

MiB = 1 << 20
LIVENESS = 3.0  # gs.worker_liveness_timeout
HEARTBEAT = 0.5
REPAIR = 0.5  # worker.repair_interval
CONFIG = {"gs.worker_liveness_timeout": LIVENESS, "worker.heartbeat_interval": HEARTBEAT,
          "worker.repair_interval": REPAIR, "worker.prefault_bytes": 0}
# A lost copy is noticed once the holder's heartbeats are older than the liveness timeout, then made at the next
# repair pass (a few, on a busy machine), and copying 1 MiB between local workers takes well under the rest.
REPAIRED_WITHIN = LIVENESS + HEARTBEAT + 6 * REPAIR + 10.0
T = TypeVar("T")


def _data(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, MiB, dtype=np.uint8)


def _holders(art: tc.Artifact) -> set[str]:
    return {r.worker_id for r in art.replicas if r.alive}


def eventually(probe: Callable[[], T], done: Callable[[T], bool], timeout: float) -> T:
    deadline = time.monotonic() + timeout
    while True:
        got = probe()
        if done(got):
            return got
        assert time.monotonic() < deadline, f"still {got!r} after {timeout:g} s"
        time.sleep(0.1)


def missing_metric(cluster: LocalCluster) -> float:
    with urllib.request.urlopen(cluster.metrics_urls["gs"] + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    m = re.search(r"^tensorcast_replicas_missing (\S+)$", text, re.M)
    assert m is not None, "tensorcast_replicas_missing is not served"
    return float(m.group(1))


def test_ha_puts_right_after_a_kill_have_both_copies_on_live_workers() -> None:
    with running_cluster(workers=3, memory_capacity="128MiB", config=CONFIG) as cluster, \
            tc.connect(cluster.address) as c:
        gateway = "w0"  # the client's first gateway: where the puts land
        cluster.kill_worker("w1")  # still listed alive for up to the liveness timeout
        killed_at = time.monotonic()
        arts = []
        while len(arts) < 8 and (not arts or time.monotonic() - killed_at < LIVENESS / 2):
            arts.append(c.put(_data(len(arts)), policy="ha"))  # while w1 still looks alive (the old code's target)
        for art in arts:
            assert art.replicas_wanted == 2 and art.copies == 2, art.replicas
            assert _holders(art) == {gateway, "w2"}
        # One live worker left: the put succeeds with what it got and says so.
        cluster.kill_worker("w2")
        lone = c.put(_data(99), policy="ha")
        assert lone.copies == 1 and lone.replicas_wanted == 2 and _holders(lone) == {gateway}
        assert np.array_equal(lone.tensor(like="numpy"), _data(99))


def test_a_lost_copy_is_made_again_on_a_live_worker() -> None:
    with running_cluster(workers=3, memory_capacity="128MiB", config=CONFIG) as cluster, \
            tc.connect(cluster.address) as c:
        art = c.put(_data(1), key="ha/one", policy="ha")
        (second,) = _holders(art) - {"w0"}
        third = ({"w1", "w2"} - {second}).pop()
        cluster.kill_worker(second)
        got = eventually(lambda: c.artifact("ha/one"), lambda a: third in _holders(a), REPAIRED_WITHIN)
        assert got.copies == 2 and _holders(got) == {"w0", third}
        assert missing_metric(cluster) == 0 and cluster_state(c)["replicas_missing"] == 0
        assert np.array_equal(got.tensor(like="numpy", source="local_only"), _data(1))


def test_missing_copies_are_shown_until_a_restarted_worker_takes_them_again() -> None:
    """Two workers: with one dead there is nowhere to copy to, and the metric and ``status`` say a copy is
    missing; the worker comes back without its memory, and the copy is made on it."""
    with running_cluster(workers=2, memory_capacity="128MiB", config=CONFIG) as cluster, \
            tc.connect(cluster.address) as c:
        art = c.put(_data(2), key="ha/two", policy=tc.Placement(memory="preferred", disk="required", replicas=2))
        assert _holders(art) == {"w0", "w1"} and art.replicas_wanted == 2
        assert missing_metric(cluster) == 0
        cluster.kill_worker("w1")
        eventually(lambda: missing_metric(cluster), lambda n: n == 1, LIVENESS + HEARTBEAT + 5.0)
        assert cluster_state(c)["replicas_missing"] == 1 and c.artifact("ha/two").copies == 1
        cluster.restart_worker("w1")  # registers again: its memory copy is gone
        got = eventually(lambda: c.artifact("ha/two"), lambda a: a.copies == 2, REPAIRED_WITHIN)
        assert _holders(got) == {"w0", "w1"}
        assert eventually(lambda: missing_metric(cluster), lambda n: n == 0, 5.0) == 0
        assert cluster_state(c)["replicas_missing"] == 0
