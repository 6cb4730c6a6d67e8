"""A synchronous client's lookups on the caller's own thread (``client.thread_calls``), against real processes
of a cluster with a token: a lookup and a first read never hop to the client's event loop; threads looking up
at once each get their own connection and only their own replies; a gateway killed with -9 is left for the
next one (the loop's fail-over) and lookups come back to the caller's thread there; a forked child never
uses its parent's connections; off, every lookup goes through the loop."""

from __future__ import annotations

import gc
import os
import socket
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import tensorcast as tc
from tensorcast.client import thread_calls
from tensorcast.cluster import LocalCluster
from tensorcast.errors import NotFound
from tensorcast.testing import running_cluster

SECRET = "thread-lookups-secret"


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with running_cluster(workers=1, token=SECRET, config={"worker.prefault_bytes": 0}) as c:
        yield c


class LoopHops:
    """Counts what a synchronous client hands to its event-loop thread."""

    def __init__(self, client: tc.Client) -> None:
        self.n = 0
        submit = client._loop.submit

        def counted(coro: Any) -> Any:
            self.n += 1
            return submit(coro)

        client._loop.submit = counted  # type: ignore[method-assign]


def _connect(cluster: LocalCluster) -> tc.Client:
    return tc.connect(cluster.address, token=cluster.credential("client"), config=cluster.client_config())


def test_a_lookup_and_a_first_read_stay_on_the_callers_thread(cluster: LocalCluster) -> None:
    with _connect(cluster) as client:
        data = np.arange(1 << 16, dtype=np.int32)
        art = client.put({"x": data}, key="thread/one")
        art.tensor("x", like="numpy")  # its first read ever: the worker checks the bytes a same-host put wrote
        hops = LoopHops(client)
        for key in (art.id, "thread/one"):
            client.aio.reader.kept.forget(art.id)
            got = client.artifact(key)
            assert got.id == art.id and got.key == "thread/one"
            np.testing.assert_array_equal(got.tensor("x", like="numpy"), data)
        with pytest.raises(NotFound):
            client.artifact("thread/missing")
        assert hops.n == 0, "a lookup or its first read went through the event loop"
        assert client._threads.connections() == 1
        client.delete(art.id)
        with pytest.raises(NotFound):
            client.artifact(art.id)


def test_threads_each_get_their_own_connection_and_their_own_replies(cluster: LocalCluster) -> None:
    with _connect(cluster) as client:
        arts = {i: client.put({"x": np.full(256, i, dtype=np.int64)}, key=f"thread/{i}") for i in range(4)}
        errors: list[BaseException] = []
        started = threading.Barrier(4)

        def look(i: int) -> None:
            try:
                started.wait()
                for n in range(200):
                    j = (i + n) % 4
                    got = client.artifact(f"thread/{j}")
                    assert got.id == arts[j].id
                    assert int(got.tensor("x", like="numpy")[0]) == j
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=look, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors[:1]
        assert not any(t.is_alive() for t in threads)
        del threads
        gc.collect()
        assert client._threads.connections() == 0, "a thread that ended left its connection open"
        client.artifact("thread/0")
        assert client._threads.connections() == 1
        for a in arts.values():
            client.delete(a.id)
    assert client._threads.connections() == 0


def test_a_gateway_killed_is_left_for_the_next_and_lookups_come_back_to_the_thread() -> None:
    with running_cluster(workers=2, token=SECRET, config={"worker.prefault_bytes": 0}) as cluster, \
            _connect(cluster) as client:
        data = np.arange(1024, dtype=np.float32)
        art = client.put({"x": data}, key="thread/failover", policy="ha")
        first, other = cluster.workers["w0"].address, cluster.workers["w1"].address
        assert client.aio.caller.address == first
        client.artifact("thread/failover")
        cluster.kill_worker("w0")
        got = client.artifact("thread/failover", timeout=30)  # the thread's connection is dead: the loop's way
        assert got.id == art.id and client.aio.caller.address == other
        np.testing.assert_array_equal(got.tensor("x", like="numpy"), data)
        hops = LoopHops(client)
        client.aio.reader.kept.forget(art.id)
        assert client.artifact("thread/failover").id == art.id
        assert hops.n == 0, "after the fail-over, lookups did not come back to the caller's thread"


def test_a_forked_child_never_uses_its_parents_connections(cluster: LocalCluster) -> None:
    with _connect(cluster) as client:
        art = client.put({"x": np.zeros(8)}, key="thread/fork")
        client.artifact(art.id)  # this thread holds a connection now
        msg, ctx = client.aio.lookup_request(art.id, timeout=5)
        read, write = os.pipe()
        with warnings.catch_warnings():  # forking a process with threads: what this test is about
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            try:
                os.write(write, b"none" if client._threads.call(msg, ctx) is None else b"used")
            finally:
                os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        with os.fdopen(read, "rb") as f:
            assert f.read() == b"none"
        assert client.artifact(art.id).id == art.id  # the parent's connection is intact
        client.delete(art.id)


def test_turned_off_every_lookup_goes_through_the_loop(cluster: LocalCluster) -> None:
    config = cluster.client_config()
    off = tc.Config.from_flat({"client.thread_lookups": False, "tls.enabled": config.tls.enabled})
    with tc.connect(cluster.address, token=cluster.credential("client"), config=off) as client:
        art = client.put({"x": np.zeros(8)})
        hops = LoopHops(client)
        client.artifact(art.id)
        assert hops.n == 1 and client._threads.connections() == 0
        client.delete(art.id)


def test_a_gateway_refusing_new_connections_is_tried_this_way_once_per_back_off(cluster: LocalCluster) -> None:
    """A gateway that closes new connections (at its connection limit) costs one failed connection per
    back-off, doubling while it keeps refusing, not one per lookup; lookups go through the loop meanwhile."""
    with _connect(cluster) as client:
        art = client.put({"x": np.zeros(8)})
        closer = socket.create_server(("127.0.0.1", 0))  # accepts and closes: a gateway refusing connections
        accepted: list[int] = []

        def refuse() -> None:
            while True:
                try:
                    conn, _ = closer.accept()
                except OSError:
                    return
                accepted.append(1)
                conn.close()

        threading.Thread(target=refuse, daemon=True).start()
        now = [1000.0]
        caller = client.aio.caller
        threads = thread_calls.ThreadCalls(caller, clock=lambda: now[0])
        real = caller.address
        msg, ctx = client.aio.lookup_request(art.id, timeout=10)
        try:
            caller.address = f"127.0.0.1:{closer.getsockname()[1]}"
            assert threads.call(msg, ctx) is None and len(accepted) == 1
            for _ in range(5):
                assert threads.call(msg, ctx) is None
            assert len(accepted) == 1, "tried again within its back-off"
            now[0] += thread_calls.BACKOFF_S + 0.01
            assert threads.call(msg, ctx) is None and len(accepted) == 2
            now[0] += thread_calls.BACKOFF_S + 0.01  # the back-off doubled: not yet
            assert threads.call(msg, ctx) is None and len(accepted) == 2
            now[0] += thread_calls.BACKOFF_S
            assert threads.call(msg, ctx) is None and len(accepted) == 3
        finally:
            caller.address = real
            closer.close()
            threads.close()
        threads = thread_calls.ThreadCalls(caller, clock=lambda: now[0])
        assert threads.call(msg, ctx) is not None  # the gateway in use: this way
        threads.close()
        client.delete(art.id)


def test_a_lookup_on_the_clients_own_loop_thread_is_refused_as_before(cluster: LocalCluster) -> None:
    with _connect(cluster) as client:
        art = client.put({"x": np.zeros(8)})
        got: list[BaseException] = []
        done = threading.Event()

        def on_loop() -> None:
            try:
                client.artifact(art.id)
            except BaseException as exc:
                got.append(exc)
            done.set()

        client._loop.loop.call_soon_threadsafe(on_loop)
        assert done.wait(10)
        assert len(got) == 1 and isinstance(got[0], RuntimeError) and "own event loop" in str(got[0])
        client.delete(art.id)
