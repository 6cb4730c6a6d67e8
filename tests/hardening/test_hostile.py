"""Hostile input against real processes: no frame, request or peer ends a server loop or locks others out.

- msgpack nested too deep (a 3 KB frame) before and after the handshake, on every port: typed errors, the
  loops live on (the data plane used to die of a RecursionError in its selector thread), and the log stays
  bounded (no traceback per frame);
- data requests with bad slices are answered, never left hanging (252 of them used to lock a peer out);
- readers that stop reading give their sender threads back (``transport.send_progress_timeout``);
- sockets re-opened as they close, never authenticating, cannot lock authenticated peers out
  (``transport.max_unauthenticated``);
- ``/healthz`` answers for the data plane's own liveness (its loop unit-tested in tests/transport).
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

import tensorcast as tc
from tensorcast.cluster import LocalCluster
from tensorcast.kv.keys import shard_of
from tensorcast.records import SliceSpec
from tensorcast.testing import RawPeer, running_cluster
from tensorcast.transport.tcp_frames import recv_frame, send_frame
from tensorcast.wire.frames import pack_header
from tensorcast.wire.kv_messages import KVPut
from tensorcast.wire.messages import PROTOCOL_VERSION, DataHello, DataReply, DataRequest, ErrorReply
from tensorcast.wire.protocol import ERROR, REQUEST, Envelope

PROGRESS = 2.0  # transport.send_progress_timeout in this cluster
CONFIG = {"wire.handshake_timeout": 2.0, "transport.send_progress_timeout": PROGRESS,
          "transport.max_unauthenticated": 16, "wire.max_connections": 200, "wire.max_unauthenticated": 32}
FAR = tc.Config.from_flat({"client.host_id": "elsewhere"})  # every read takes the data plane


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with running_cluster(workers=1, config=CONFIG) as c:
        yield c


def nested_frame(depth: int = 3000) -> bytes:
    """A frame whose message is msgpack arrays nested ``depth`` deep (~3 KB)."""
    raw = b"\x91" * depth + b"\xc0"
    body = msgspec.msgpack.encode(Envelope(1, REQUEST, "deep", None, msgspec.Raw(raw)))
    return pack_header(len(body), 0) + body


def data_address(cluster: LocalCluster) -> tuple[str, int]:
    host, port = cluster.workers["w0"].info["data_address"].rsplit(":", 1)  # type: ignore[index]
    return host, int(port)


def data_peer(cluster: LocalCluster) -> socket.socket:
    """An authenticated data-plane connection."""
    sock = socket.create_connection(data_address(cluster), timeout=5)
    send_frame(sock, REQUEST, DataHello(protocol_version=PROTOCOL_VERSION))
    _, reply = recv_frame(sock, 1 << 16, time.time() + 5)
    assert isinstance(reply, DataReply)
    return sock


def served(cluster: LocalCluster, timeout: float = 10.0) -> float:
    """Seconds a remote read takes (bytes checked): the data plane serves."""
    t0 = time.monotonic()
    with tc.connect(cluster.address) as c, tc.connect(cluster.address, config=FAR) as remote:
        data = np.arange(4096, dtype=np.int64)
        art = c.put(data)
        got = remote.artifact(art.id).tensor(like="numpy")
        assert np.array_equal(got, data)
        c.delete(art.id)
    took = time.monotonic() - t0
    assert took < timeout
    return took


def healthz(cluster: LocalCluster) -> int:
    url = cluster.metrics_urls["w0"] + "/healthz"
    try:
        return int(urllib.request.urlopen(url, timeout=5).status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def tracebacks(log: Path) -> int:
    return log.read_text().count('"exc": ')


def test_deeply_nested_frames_end_no_loop_and_flood_no_log(cluster: LocalCluster) -> None:
    log = Path(cluster.workers["w0"].log_path)
    before = tracebacks(log)
    frame = nested_frame()
    assert 2500 < len(frame) < 4000
    targets = [data_address(cluster), cluster.address.rsplit(":", 1), cluster.gs_address.rsplit(":", 1)]
    for host, port in targets:
        for _ in range(50):  # before the handshake
            with socket.create_connection((host, int(port)), timeout=5) as sock:
                sock.sendall(frame)
                sock.settimeout(5)
                while sock.recv(65536):  # an error frame, then the close
                    pass
    for _ in range(50):  # after it, on the data plane
        with data_peer(cluster) as sock:
            sock.sendall(frame)
            env, msg = recv_frame(sock, 1 << 16, time.time() + 5)
            assert env.kind == ERROR and isinstance(msg, ErrorReply) and msg.code == "INVALID_ARGUMENT"
    for _ in range(50):  # and on the control port, after its handshake: a typed error, then the close
        peer = RawPeer(cluster.address)
        try:
            peer.hello()
            peer.send_raw(frame)
            env, msg = peer.recv()
            assert env.kind == ERROR and msg.code == "INVALID_ARGUMENT"
        finally:
            peer.close()
    served(cluster)
    assert healthz(cluster) == 200
    assert tracebacks(log) - before == 0, "a traceback for a malformed frame"


def test_every_data_request_is_answered(cluster: LocalCluster) -> None:
    with tc.connect(cluster.address) as c:
        art = c.put({"w": np.ones((8, 8), np.float32)})
        bad = [SliceSpec(dim=99, start=0, stop=1), SliceSpec(dim=0, start=0, stop=4, step=0),
               SliceSpec(dim=0, start=5, stop=2), SliceSpec(dim=1, start=0, stop=1 << 40)]
        for i in range(300):  # more than a peer may hold connections (the per-peer cap) at once
            with data_peer(cluster) as sock:
                send_frame(sock, REQUEST, DataRequest(artifact_id=art.id, name="w", slices=(bad[i % len(bad)],)))
                env, msg = recv_frame(sock, 1 << 16, time.time() + 5)
                assert env.kind == ERROR and msg.code == "INVALID_ARGUMENT", msg
        served(cluster)
        c.delete(art.id)


def test_readers_that_stop_reading_give_their_senders_back(cluster: LocalCluster) -> None:
    with tc.connect(cluster.address) as c:
        big = c.put({"w": np.ones(64 << 20, np.uint8)})
        stuck = []
        try:
            for _ in range(12):  # more than the worker's sender threads
                sock = data_peer(cluster)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                send_frame(sock, REQUEST, DataRequest(artifact_id=big.id, name="w"))
                stuck.append(sock)  # never read
            time.sleep(0.5)
            # Served once the stuck sends passed their progress deadline (not never).
            assert served(cluster, timeout=PROGRESS * 3 + 10) > 0
        finally:
            for sock in stuck:
                sock.close()
        c.delete(big.id)


@pytest.mark.parametrize("port", ["data", "control"])
def test_silent_sockets_reopened_as_they_close_lock_nobody_out(cluster: LocalCluster, port: str) -> None:
    """More silent sockets than the server takes in all (wire.max_connections 200 here), re-opened as the
    server closes them: authenticated peers still get in."""
    address = data_address(cluster) if port == "data" else tuple(cluster.address.rsplit(":", 1))
    stop = threading.Event()
    opened = [0]

    def flood() -> None:
        socks: list[socket.socket] = []
        while not stop.is_set():
            socks = [s for s in socks if s.fileno() != -1]
            while len(socks) < 300 and not stop.is_set():
                try:
                    socks.append(socket.create_connection((address[0], int(address[1])), timeout=1))
                    opened[0] += 1
                except OSError:
                    break
            for s in list(socks):  # re-open those the server closed
                s.setblocking(False)
                try:
                    if s.recv(1) == b"":
                        s.close()
                except BlockingIOError:
                    pass
                except OSError:
                    s.close()
            time.sleep(0.01)
        for s in socks:
            s.close()

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while opened[0] <= 400:  # the server closed silent ones to make room, and they came back
            assert time.monotonic() < deadline, opened
            time.sleep(0.05)
        for _ in range(3):
            served(cluster)
    finally:
        stop.set()
        thread.join(timeout=10)


def _peak_rss(pid: int) -> int:
    """The process's peak resident memory so far (what a transient allocation leaves behind)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def test_a_kv_put_allocates_nothing_before_its_sizes_are_checked(cluster: LocalCluster) -> None:
    with tc.connect(cluster.address) as c:
        key = "hostile-page"
        assert c.kv.put([key], [np.ones(4096, np.uint8)]) == 1
        table = c.list_shards()
        lease = next(x for x in table.leases if x.shard == shard_of(key, table.num_shards))
        pid = cluster.workers["w0"].pid
        before = _peak_rss(pid)
        for i in range(20):  # 1 GiB declared for an existing key, one byte sent
            peer = RawPeer(lease.address)
            try:
                peer.hello()
                peer.send(KVPut(keys=(key,), sizes=(1 << 30,), tokens={lease.shard: lease.token}), request_id=2 + i,
                          payload=b"x")
                env, msg = peer.recv()
                assert env.kind == ERROR and msg.code == "INVALID_ARGUMENT", msg
            finally:
                peer.close()
        assert _peak_rss(pid) - before < 64 << 20  # no 1 GiB buffer, not even for a moment
        got = c.kv.get([key])[0]
        assert got is not None and np.array_equal(got, np.ones(4096, np.uint8))  # nothing lost
