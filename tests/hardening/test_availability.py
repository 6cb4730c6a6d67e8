"""Availability with real processes: KV calls wait out shard hand-overs (start-up, a home killed), and a
client survives the loss of its gateway. Every byte returned is checked."""

from __future__ import annotations

import threading
import time

import numpy as np
import xxhash

import tensorcast as tc
from tensorcast.kv import KVLayout, page_keys
from tensorcast.testing import running_cluster

LAYOUT = KVLayout("avail-model", layers=2, kv_heads=2, head_dim=32, dtype="float16", page_size=16)
TTL, RENEW = 2.0, 0.5
KV_CONFIG = {"kv.lease_ttl": TTL, "kv.renew_interval": RENEW}


def page_for(key: str) -> np.ndarray:
    """Every page's content is a function of its key: a wrong page is always recognized."""
    return np.random.default_rng(xxhash.xxh3_64_intdigest(key.encode())).integers(
        0, 255, LAYOUT.page_bytes, dtype=np.uint8)


def kv_loop(client: tc.Client, stop: threading.Event, errors: list[BaseException], stats: dict[str, int]) -> None:
    """Puts and gets, one small batch after another, until ``stop``; checks every page it gets back."""
    seq = 0
    while not stop.is_set():
        seq += 1
        keys = page_keys([seq * 1000 + i for i in range(4 * LAYOUT.page_size)], LAYOUT)
        try:
            client.kv.put(keys, [page_for(k) for k in keys])
            got = client.kv.get(keys)
        except BaseException as exc:
            errors.append(exc)
            return
        for key, page in zip(keys, got, strict=True):
            if page is None:
                stats["misses"] += 1
            elif not np.array_equal(page, page_for(key)):
                errors.append(AssertionError(f"wrong bytes for {key}"))
                return
            else:
                stats["hits"] += 1
        stats["batches"] += 1


def test_kv_calls_wait_out_start_up_and_a_failover() -> None:
    with running_cluster(workers=3, config=KV_CONFIG) as cluster, tc.connect(cluster.address) as c:
        # From the first moment: the shards are not leased yet when the cluster reports ready.
        stop, errors = threading.Event(), []
        stats = {"hits": 0, "misses": 0, "batches": 0}
        loop = threading.Thread(target=kv_loop, args=(c, stop, errors, stats))
        loop.start()
        try:
            time.sleep(2 * TTL + 2 * RENEW)  # start-up: shards settle on their homes
            cluster.kill_worker("w2")  # a shard home dies under load: its shards move
            time.sleep(2 * TTL + 2 * RENEW)
        finally:
            stop.set()
            loop.join(timeout=60)
        assert not errors, errors[0]
        assert stats["batches"] > 10 and stats["hits"] > 0, stats


def test_a_client_survives_the_loss_of_its_gateway() -> None:
    """kill -9 the gateway a client connected to, under a put/get and KV loop: calls continue through another
    gateway within a second, and no byte is wrong. Artifacts whose only copy was in the killed worker's memory
    are gone with it (a miss), nothing else is."""
    with running_cluster(workers=3, config=KV_CONFIG) as cluster, tc.connect(cluster.address) as c:
        stop = threading.Event()
        done: list[float] = []  # when each put + get round finished
        errors: list[BaseException] = []
        killed_at = [float("inf")]

        def artifacts() -> None:
            i = 0
            while not stop.is_set():
                i += 1
                data = np.arange(1000, dtype=np.int64) * i
                try:
                    art = c.put({"x": data}, key=f"fo/{i}", timeout=10)
                    got = c.artifact(f"fo/{i}", timeout=10).tensor("x", like="numpy")
                    c.list_workers()
                except tc.errors.TensorCastError as exc:
                    if not (isinstance(exc, tc.errors.Unavailable | tc.errors.NotFound) and
                            time.monotonic() - killed_at[0] < 2.0):
                        errors.append(exc)  # only the round the kill cut through may fail
                    continue
                if not np.array_equal(got, data):
                    errors.append(AssertionError(f"wrong bytes for {art.id}"))
                done.append(time.monotonic())

        kv_stats = {"hits": 0, "misses": 0, "batches": 0}
        threads = [threading.Thread(target=artifacts), threading.Thread(target=kv_loop, args=(c, stop, errors,
                                                                                               kv_stats))]
        for t in threads:
            t.start()
        try:
            time.sleep(2 * TTL + 2 * RENEW)  # shards settled, rounds flowing
            killed_at[0] = time.monotonic()
            cluster.kill_worker("w0")  # the gateway the client connected to
            time.sleep(3.0)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
        assert not errors, errors
        after = [t for t in done if t > killed_at[0]]
        assert after and after[0] - killed_at[0] < 1.0, "calls did not continue within a second"
        assert len(after) > 10
        assert c.aio.caller.address != cluster.workers["w0"].address
