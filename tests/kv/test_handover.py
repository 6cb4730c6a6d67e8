"""Acknowledged KV pages survive the events of an ordinary day, with real processes: a cluster starting, a
graceful stop (drain) and a global-store outage longer than the lease TTL. The simulated cluster runs these
and more (a join, an outage within the TTL, a kill -9 with backups) in virtual time over many seeds
(``tests/sim``); these stay as the check that it models what real processes do."""

from __future__ import annotations

import time

import numpy as np
import xxhash

import tensorcast as tc
from tensorcast.kv.keys import KVLayout, page_keys
from tensorcast.testing import running_cluster, wait_shards_settled

LAYOUT = KVLayout("handover-model", layers=2, kv_heads=2, head_dim=16, dtype="float16", page_size=16)
TTL, RENEW = 2.0, 0.5
FAST = {"kv.lease_ttl": TTL, "kv.renew_interval": RENEW}
PAGES = 1000


def page_for(key: str) -> np.ndarray:
    """Every page's content is a function of its key: a wrong page can always be recognized."""
    seed = xxhash.xxh3_64_intdigest(key.encode())
    return np.random.default_rng(seed).integers(0, 255, LAYOUT.page_bytes, dtype=np.uint8)


def put_pages(c: tc.Client, n: int = PAGES, seq: int = 0) -> list[str]:
    keys = page_keys([seq * 1_000_003 + i for i in range(n * LAYOUT.page_size)], LAYOUT)
    assert c.kv.put(keys, [page_for(k) for k in keys], layout=LAYOUT) == n
    return keys


def readable(c: tc.Client, keys: list[str]) -> int:
    """Pages read back with their own bytes (a wrong page fails the test at once)."""
    got = c.kv.get(keys)
    wrong = [k for k, g in zip(keys, got, strict=True) if g is not None and not np.array_equal(g, page_for(k))]
    assert not wrong, f"{len(wrong)} pages with other bytes"
    return sum(g is not None for g in got)


def test_pages_put_as_a_cluster_starts_are_all_readable_once_it_settled() -> None:
    with running_cluster(workers=4, config=FAST) as cluster, tc.connect(cluster.address) as c:
        keys = put_pages(c)
        wait_shards_settled(c, set(cluster.worker_ids))
        assert readable(c, keys) == PAGES


def test_a_graceful_stop_hands_every_page_over() -> None:
    with running_cluster(workers=3, config=FAST) as cluster, tc.connect(cluster.address) as c:
        wait_shards_settled(c, set(cluster.worker_ids))
        keys = put_pages(c)
        leaving = "w1"  # not the gateway the client uses
        t0 = time.monotonic()
        assert cluster.stop_worker(leaving) == 0
        drained = time.monotonic() - t0
        wait_shards_settled(c, {w for w in cluster.worker_ids if w != leaving}, timeout=TTL * 5)
        assert readable(c, keys) == PAGES
        # The drain ends once its pages were taken, well before the hand-over timeout (10 s).
        assert drained < 2 * TTL + 4 * RENEW + 3, drained


def test_a_longer_global_store_outage_moves_shards_without_losing_pages() -> None:
    """Past the lease TTL every lease expires at the store, and homes that see stale heartbeats grab others'
    shards for a while: every one of those moves is a hand-over."""
    with running_cluster(workers=3, config=FAST) as cluster, tc.connect(cluster.address) as c:
        wait_shards_settled(c, set(cluster.worker_ids))
        keys = put_pages(c)
        cluster.kill_global_store()
        time.sleep(2 * TTL + 1.0)
        cluster.restart_global_store()
        wait_shards_settled(c, set(cluster.worker_ids), timeout=30)
        assert readable(c, keys) == PAGES
