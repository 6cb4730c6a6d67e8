"""Failure handling with real processes: overflow, kill -9, SIGSTOP, global-store restart, deadlines."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
from typing import Any

import numpy as np
import pytest

import tensorcast as tc
import tensorcast.aio
from tensorcast.errors import DeadlineExceeded, NotFound, ResourceExhausted, Unavailable
from tensorcast.testing import running_cluster
from tensorcast.wire.messages import PutBegin


def test_overflow_is_refused_and_worker_keeps_serving() -> None:
    with running_cluster(workers=1, memory_capacity="4MiB") as cluster, tc.connect(cluster.address) as c:
        a = c.put(np.ones(3 << 18, np.uint8), key="fits")  # 768 KiB
        with pytest.raises(ResourceExhausted):
            c.put(np.zeros(5 << 20, np.uint8))  # more than the whole tier: eviction cannot help
        with pytest.raises(ResourceExhausted):  # warm refuses rather than evicting "fits"
            c.put({"x": np.zeros(2 << 20, np.uint8), "y": np.ones(2 << 20, np.uint8)}, policy="warm")
        # Nothing was kept from the refused puts; the worker still serves and still has room.
        b = c.put(np.full(3 << 20, 7, np.uint8), key="fits-too")
        assert np.array_equal(c.artifact("fits").tensor(like="numpy"), np.ones(3 << 18, np.uint8))
        assert c.artifact("fits-too").tensor(like="numpy")[123] == 7
        c.delete(a.id)
        c.delete(b.id)


def test_global_store_restart_keeps_acknowledged_records() -> None:
    with running_cluster(workers=1) as cluster, tc.connect(cluster.address) as c:
        ids = {f"gs/{i}": c.put(np.full(16, i, np.int64), key=f"gs/{i}").id for i in range(20)}
        leased = c.put(np.arange(3), key="gs/leased", ttl=60)
        cluster.restart_global_store()  # kill -9, then start on the same data dir and port
        for key, aid in ids.items():
            art = c.artifact(key)
            assert art.id == aid
        assert c.artifact("gs/leased").owner == "lease"
        assert np.array_equal(c.artifact("gs/7").tensor(like="numpy"), np.full(16, 7, np.int64))
        assert sorted(a.key or "" for a in c.ls("gs/")) == sorted([*ids, "gs/leased"])
        # Puts work again once the worker's connection to the new GS process is re-established.
        c.put(np.arange(2), key="gs/after")
        assert c.artifact("gs/after").id
        del leased


def test_killed_worker_loses_memory_replicas_and_restarts_clean() -> None:
    with running_cluster(workers=2) as cluster:
        _, w1 = cluster.worker_ids
        holder = tc.connect(cluster.workers[w1].address)
        gateway = tc.connect(cluster.address)
        try:
            art = holder.put(np.arange(1000), key="on-w1")
            assert [r.worker_id for r in art.replicas] == [w1]
            cluster.kill_worker(w1)
            with pytest.raises(Unavailable):
                gateway.artifact("on-w1").tensor(like="numpy")
            cluster.restart_worker(w1)
            # Memory replicas do not survive a restart: the artifact is gone (a miss), not listed without a
            # replica.
            with pytest.raises(NotFound, match="lost"):
                gateway.artifact("on-w1")
            deadline = time.time() + 10
            while time.time() < deadline:
                alive = {w.worker_id: w.alive for w in gateway.list_workers()}
                if alive.get(w1):
                    break
                time.sleep(0.2)
            assert alive[w1]
        finally:
            holder.close()
            gateway.close()


def test_paused_worker_calls_fail_with_deadline_exceeded() -> None:
    with running_cluster(workers=1) as cluster, tc.connect(cluster.address) as c:
        art = c.put(np.arange(10), key="paused")
        cluster.pause_worker(cluster.worker_ids[0])
        try:
            t0 = time.time()
            with pytest.raises(DeadlineExceeded):
                c.artifact("paused", timeout=0.5)
            assert time.time() - t0 < 3.0
        finally:
            cluster.resume_worker(cluster.worker_ids[0])
        assert c.artifact("paused").id == art.id
        # A context whose deadline already passed never starts the call.
        ctx = tc.context(timeout=0.0)
        with pytest.raises(DeadlineExceeded):
            c.put(np.arange(3), ctx=ctx)
        with pytest.raises(NotFound):
            c.artifact("never-put")


def _gauge(url: str, name: str, *labels: str) -> float:
    """A sample of the worker's metrics: the sum of ``name``'s samples with every one of ``labels``."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(label in line for label in labels))


def _reserved(url: str) -> float:
    """The worker's memory reserved for puts in flight."""
    return _gauge(url, "tensorcast_pool_bytes", 'state="reserved"', 'tier="memory"')


def _begins_served(url: str) -> float:
    return _gauge(url, "tensorcast_rpc_served_total", 'method="PutBegin"')


def test_a_put_cancelled_before_its_plan_arrives_frees_its_room_at_once() -> None:
    """The worker answers PutBegin after the caller gave up (here: the worker was paused meanwhile). The
    room it reserved is given back when the answer arrives, not after ``worker.put_timeout`` (minutes)."""
    with running_cluster(workers=1) as cluster:
        wid = cluster.worker_ids[0]
        url = cluster.metrics_urls[wid]

        async def main() -> None:
            async with await tc.aio.connect(cluster.address) as c:
                await c.put(np.arange(10))  # the connection is up: the put below sends PutBegin at once
                begins = _begins_served(url)
                begun = asyncio.Event()
                inner = c.caller.call

                async def call(msg: Any, *args: Any, **kwargs: Any) -> Any:
                    if isinstance(msg, PutBegin):
                        begun.set()
                    return await inner(msg, *args, **kwargs)

                c.caller.call = call  # type: ignore[method-assign]
                cluster.pause_worker(wid)
                try:
                    put = asyncio.ensure_future(c.put(np.ones(8 << 20, np.uint8)))
                    await asyncio.wait_for(begun.wait(), 10.0)
                    await asyncio.sleep(0.2)  # on its way: written to the socket (the loop has nothing else to do)
                    assert not put.done()
                    put.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await put
                finally:
                    cluster.resume_worker(wid)
                # The worker answers now and reserves 8 MiB; the late answer's put is aborted.
                deadline = time.monotonic() + 10.0
                while _begins_served(url) == begins:
                    assert time.monotonic() < deadline, "the worker never answered PutBegin"
                    await asyncio.sleep(0.05)
                while _reserved(url) > 0:
                    assert time.monotonic() < deadline, "the cancelled put kept its room"
                    await asyncio.sleep(0.05)

        asyncio.run(main())


def _gs_groups(cluster: tc.LocalCluster) -> float:
    """How many CommitArtifacts (group commits) the global store has served since it started."""
    with urllib.request.urlopen(cluster.metrics_urls["gs"] + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('tensorcast_rpc_served_seconds_count{method="CommitArtifacts"}'))


def test_concurrent_durable_puts_survive_kill_9_of_worker_and_global_store() -> None:
    """Puts that commit together (one group commit, one fsync) are each acknowledged only once durable:
    kill -9 of the worker and of the global store right after the last put returns loses none of them."""
    with running_cluster(workers=1) as cluster:
        clients = [tc.connect(cluster.address) for _ in range(8)]
        try:
            put: dict[str, int] = {}

            def one(c: tc.Client, k: int, round_: int) -> None:
                for i in range(4):
                    key = f"durable/{round_}/{k}/{i}"
                    c.put(np.full(1024, k * 100 + i, np.int32), key=key, policy="durable")
                    put[key] = k * 100 + i

            for round_ in range(5):  # until some commits went together (nearly always the first round)
                threads = [threading.Thread(target=one, args=(c, k, round_)) for k, c in enumerate(clients)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                if _gs_groups(cluster):
                    break
            assert _gs_groups(cluster) > 0 and len(put) >= 32
        finally:
            for c in clients:
                c.close()
        cluster.kill_worker("w0")
        cluster.kill_global_store()
        cluster.restart_global_store()
        cluster.restart_worker("w0")
        with tc.connect(cluster.address) as c:
            for key, value in put.items():
                got = c.artifact(key).tensor(like="numpy")
                assert got.shape == (1024,) and int(got[0]) == value and int(got[-1]) == value, key


def test_concurrent_puts_across_a_global_store_kill_leave_nothing_dangling() -> None:
    """Eight callers put (some in groups of commits) while the global store is killed with -9 and started again:
    every put that returned is there with its bytes; every key the store lists reads back (no record of a put
    that failed points at a copy its worker has since dropped); puts work again afterwards."""
    with running_cluster(workers=1) as cluster:
        clients = [tc.connect(cluster.address) for _ in range(8)]
        acked: dict[str, int] = {}
        failed: list[str] = []
        stop = threading.Event()

        def one(c: tc.Client, k: int) -> None:
            i = 0
            while not stop.is_set() and i < 400:
                key, value = f"blip/{k}/{i}", k * 1000 + i
                try:
                    c.put(np.full(256, value, np.int32), key=key, timeout=1.0,
                          policy="durable" if i % 2 else "cache")
                    acked[key] = value
                except tc.errors.TensorCastError:
                    failed.append(key)
                i += 1

        threads = [threading.Thread(target=one, args=(c, k)) for k, c in enumerate(clients)]
        try:
            for t in threads:
                t.start()
            deadline = time.monotonic() + 30
            while len(acked) < 40 and time.monotonic() < deadline:  # puts are flowing
                time.sleep(0.01)
            cluster.kill_global_store()
            time.sleep(0.5)
            cluster.restart_global_store()
            time.sleep(1.0)
            stop.set()
            for t in threads:
                t.join(60)
        finally:
            stop.set()
            for c in clients:
                c.close()
        assert acked and failed, (len(acked), len(failed))  # both happened: the kill fell among the puts
        with tc.connect(cluster.address) as c:
            for key, value in acked.items():
                got = c.artifact(key).tensor(like="numpy")
                assert int(got[0]) == value and int(got[-1]) == value, key
            time.sleep(3.0)  # the failed puts' copies settle (recorded or dropped) once their 1 s deadlines passed
            for art in c.ls("blip/"):
                got = art.tensor(like="numpy")  # listed: readable, with the bytes its key was put with
                k, i = map(int, (art.key or "").split("/")[1:])
                assert int(got[0]) == k * 1000 + i, art.key
            c.put(np.arange(4), key="blip/after")
            assert np.array_equal(c.artifact("blip/after").tensor(like="numpy"), np.arange(4))
