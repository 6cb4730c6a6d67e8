"""Each placement policy's promise, with real worker processes."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import numpy as np
import pytest

import tensorcast as tc
from tensorcast.cluster import LocalCluster
from tensorcast.errors import NotFound, ResourceExhausted
from tensorcast.testing import running_cluster

MiB = 1 << 20


def _blob(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, n, dtype=np.uint8)


def _tiers(art: tc.Artifact) -> set[tuple[str, str]]:
    return {(r.worker_id, r.tier) for r in art.refresh().replicas}


@pytest.fixture(scope="module")
def small() -> Iterator[LocalCluster]:
    """Two workers with 8 MiB memory tiers and disk tiers; cold copies expire after 1 s."""
    with running_cluster(workers=2, memory_capacity="8MiB",
                         config={"worker.cold_memory_ttl": 1.0, "worker.prefault_bytes": 0}) as cluster:
        yield cluster


def test_cache_evicts_lru_and_never_a_pinned_replica(small: LocalCluster) -> None:
    with tc.connect(small.address) as c:
        a = c.put(_blob(3 * MiB, 1), key="lru/a")
        b = c.put(_blob(3 * MiB, 2), key="lru/b")
        a.tensor(like="numpy")  # a is now more recently used than b
        p = c.put(_blob(1 * MiB, 3), key="lru/pinned", policy="pinned")
        cc = c.put(_blob(3 * MiB, 4), key="lru/c")  # needs room: evicts b (LRU), never the pinned one
        with pytest.raises(NotFound, match="evicted"):  # its only copy went: a cache miss, not listed
            b.refresh()
        assert [x.id for x in c.ls("lru/")] == [a.id, cc.id, p.id]
        assert ("w0", "memory") in _tiers(a) and ("w0", "memory") in _tiers(p) and ("w0", "memory") in _tiers(cc)
        with pytest.raises(NotFound):
            b.tensor(like="numpy")  # through a handle that still lists the evicted replica
        assert np.array_equal(p.tensor(like="numpy"), _blob(1 * MiB, 3))
        # warm refuses instead of evicting; pinned refuses on overflow too.
        with pytest.raises(ResourceExhausted):
            c.put(_blob(4 * MiB, 5), policy="warm")
        with pytest.raises(ResourceExhausted):
            c.put(_blob(4 * MiB, 6), policy="pinned")
        assert ("w0", "memory") in _tiers(a)
        for art in (a, p, cc):
            c.delete(art.id)


def test_durable_survives_kill_and_restart_of_its_worker() -> None:
    with running_cluster(workers=1, memory_capacity="64MiB") as cluster, tc.connect(cluster.address) as c:
        data = {"w": _blob(2 * MiB, 7), "b": _blob(1000, 8)}
        art = c.put(data, key="durable/x", policy="durable")
        assert {t for _, t in _tiers(art)} == {"memory", "disk"}
        cluster.kill_worker("w0")
        cluster.restart_worker("w0")
        got = c.artifact("durable/x")
        assert {(w, t) for w, t in _tiers(got)} == {("w0", "disk")}
        out = got.tensor_dict(like="numpy")
        assert all(np.array_equal(out[k], v) for k, v in data.items())
        assert got.last_diagnostics is not None and got.last_diagnostics.tier == "disk"
        # A cache artifact does not survive the same: it is gone, not listed without a replica.
        plain = c.put(_blob(MiB, 9), key="durable/plain")
        cluster.kill_worker("w0")
        cluster.restart_worker("w0")
        with pytest.raises(NotFound, match="lost"):
            plain.refresh()
        assert [x.id for x in c.ls("durable/")] == [art.id]


def test_memory_full_durable_goes_to_disk_and_spill(small: LocalCluster) -> None:
    with tc.connect(small.address) as c:
        hog = c.put(_blob(7 * MiB, 10), policy="pinned")
        d = c.put(_blob(3 * MiB, 11), policy="durable")  # memory full and pinned: disk copy only
        assert _tiers(d) == {("w0", "disk")}
        s = c.put(_blob(3 * MiB, 12), policy=tc.Placement(memory="preferred", overflow="spill"))
        assert _tiers(s) == {("w0", "disk")}
        assert np.array_equal(s.tensor(like="numpy"), _blob(3 * MiB, 12))
        with pytest.raises(ResourceExhausted):
            c.put(_blob(3 * MiB, 13))  # cache: cannot evict a pinned replica, cannot spill
        for art in (hog, d, s):
            c.delete(art.id)


def test_cold_drops_memory_copy_after_ttl(small: LocalCluster) -> None:
    with tc.connect(small.address) as c:
        art = c.put(_blob(MiB, 14), policy="cold")
        assert {t for _, t in _tiers(art)} == {"memory", "disk"}
        deadline = time.time() + 5
        while ("w0", "memory") in _tiers(art) and time.time() < deadline:
            time.sleep(0.2)
        assert _tiers(art) == {("w0", "disk")}
        assert np.array_equal(art.tensor(like="numpy"), _blob(MiB, 14))
        c.delete(art.id)


def test_ha_puts_a_memory_replica_on_a_second_worker(small: LocalCluster) -> None:
    with tc.connect(small.address) as c:
        art = c.put(_blob(2 * MiB, 15), policy="ha")
        assert _tiers(art) == {("w0", "memory"), ("w0", "disk"), ("w1", "memory")}
        c.delete(art.id)


def test_put_on_prefetch_pin_unpin(small: LocalCluster) -> None:
    with tc.connect(small.address) as c:
        art = c.put(_blob(2 * MiB, 16), on="w1")
        assert _tiers(art) == {("w1", "memory")}
        op = art.prefetch(to="w0")
        res = op.result(timeout=30)
        assert op.done() and op.status() == "succeeded"
        assert res.source == "w1" and res.bytes_moved == 2 * MiB
        assert _tiers(art) == {("w0", "memory"), ("w1", "memory")}
        assert art.prefetch(to="w0").result(timeout=30).already_present
        # Pin on w0, then fill w0: the pinned copy stays.
        art.pin(on="w0")
        filler = c.put(_blob(6 * MiB, 17))
        assert ("w0", "memory") in _tiers(art)
        art.unpin(on="w0")
        filler2 = c.put(_blob(6 * MiB, 18))
        assert ("w0", "memory") not in _tiers(art)
        with pytest.raises(tc.errors.NotFound):
            art.prefetch(to="w9").result(timeout=10)
        for a in (art, filler, filler2):
            with contextlib.suppress(NotFound):  # filler went when filler2 needed its room (a cache miss)
                c.delete(a.id)
