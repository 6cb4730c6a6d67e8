"""Default-deny, with real processes: blank tokens, tokens sent to tokenless clusters, memory committed before
authentication, slow handshakes and idle floods on the data port, oversized echoes, refusal logs."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import tensorcast as tc
from tensorcast.cluster import LocalCluster
from tensorcast.errors import InvalidArgument, NotFound, Unauthenticated
from tensorcast.testing import RawPeer, running_cluster
from tensorcast.wire.frames import pack_header
from tensorcast.wire.messages import ErrorReply, GetArtifact
from tensorcast.wire.protocol import ERROR

MiB = 1 << 20
HANDSHAKE = 2.0  # wire.handshake_timeout in these clusters


def _rss(pid: int) -> int:
    """Resident private memory (buffers); shared memory (the pool's pre-faulted stock) is not counted."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _closed(sock: socket.socket) -> bool:
    """The peer closed the socket (after sending whatever error frame it sent)."""
    sock.settimeout(0.2)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except (TimeoutError, BlockingIOError):
        return False
    except OSError:
        return True


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with running_cluster(workers=1, config={"wire.handshake_timeout": HANDSHAKE}) as c:
        yield c


@pytest.mark.parametrize("token", ["", "   ", "\t\n"])
def test_a_blank_token_is_a_start_up_error(token: str, tmp_path: Path) -> None:
    env = {**os.environ, "TENSORCAST_TOKEN": token}
    proc = subprocess.run([sys.executable, "-m", "tensorcast", "gs", "--data-dir", str(tmp_path), "--host", "0.0.0.0"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "token is empty or blank" in proc.stderr and "Traceback" not in proc.stderr
    with pytest.raises(InvalidArgument, match="blank"):
        tc.connect("127.0.0.1:1", token=token)


def test_a_token_sent_to_a_tokenless_cluster_is_refused(cluster: LocalCluster) -> None:
    with pytest.raises(Unauthenticated, match="without a token"):
        tc.connect(cluster.address, token="s3cret")
    # The data port says the same.
    data = cluster.workers["w0"].info["data_address"]  # type: ignore[index]
    peer = RawPeer(data)
    try:
        env, msg = peer.hello("s3cret", data=True)
        assert env.kind == ERROR and isinstance(msg, ErrorReply) and msg.code == "UNAUTHENTICATED"
    finally:
        peer.close()


def test_no_memory_is_committed_before_authentication(cluster: LocalCluster) -> None:
    """64 sockets per port announce 64 MiB bodies (and payloads) before any handshake: each is refused at
    once, and neither the global store nor the worker grows."""
    assert cluster.gs is not None
    pids = {"gs": cluster.gs.pid, "w0": cluster.workers["w0"].pid}
    ports = [cluster.gs_address, cluster.address, cluster.workers["w0"].info["data_address"]]  # type: ignore[index]
    before = {name: _rss(pid) for name, pid in pids.items()}
    socks = []
    for address in ports:
        host, port = address.rsplit(":", 1)
        for i in range(64):
            s = socket.create_connection((host, int(port)))
            s.sendall(pack_header(64 * MiB, 64 * MiB * (i % 2)) + b"\0" * 4096)
            socks.append(s)
    try:
        time.sleep(0.5)
        assert all(_closed(s) for s in socks), "a server kept an unauthenticated connection announcing 64 MiB"
        for name, pid in pids.items():
            assert _rss(pid) - before[name] < 50 * MiB, f"{name} grew by {(_rss(pid) - before[name]) >> 20} MiB"
    finally:
        for s in socks:
            s.close()
    with tc.connect(cluster.address) as c:  # and it serves on
        assert c.list_workers()[0].alive


def test_large_frames_after_authentication_are_bounded_by_the_receive_budget() -> None:
    config = {"wire.receive_budget_bytes": 48 * MiB}
    with running_cluster(workers=1, config=config) as cluster:
        pid = cluster.workers["w0"].pid
        before = _rss(pid)
        peers = []
        for _ in range(12):  # 12 authenticated peers announce 32 MiB bodies and send half of them
            p = RawPeer(cluster.address)
            p.hello()
            peers.append(p)
            with contextlib.suppress(OSError):  # refused while sending: the budget is spent
                p.send_raw(pack_header(32 * MiB, 0) + b"\x01" * (16 * MiB))
        try:
            time.sleep(1.0)
            refused = sum(_closed(p.sock) for p in peers)
            assert refused >= 10, "only the receive budget (48 MiB: one 32 MiB body) may be admitted"
            assert _rss(pid) - before < 48 * MiB + 50 * MiB
        finally:
            for p in peers:
                p.close()
        # A connection that closed mid-body keeps nothing alive (no reference cycle waiting for a full GC).
        deadline = time.monotonic() + 5.0
        while _rss(pid) - before > 20 * MiB and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _rss(pid) - before <= 20 * MiB, f"{(_rss(pid) - before) >> 20} MiB still held after the close"


def test_slow_handshakes_and_idle_floods_on_the_data_port(cluster: LocalCluster) -> None:
    pid = cluster.workers["w0"].pid
    threads = _threads(pid)
    host, port = cluster.workers["w0"].info["data_address"].rsplit(":", 1)  # type: ignore[index]
    # Slowloris: one byte every 0.3 s never completes a handshake, and the deadline is total, not per read.
    slow = [socket.create_connection((host, int(port))) for _ in range(40)]
    # An idle flood: more connections than one peer may hold open at once.
    idle = [socket.create_connection((host, int(port))) for _ in range(300)]
    t0 = time.monotonic()
    try:
        hello = pack_header(2000, 0)
        for i in range(len(hello)):
            for s in slow:
                with contextlib.suppress(OSError):  # closed already
                    s.send(hello[i : i + 1])
            if time.monotonic() - t0 > HANDSHAKE + 1.5:
                break
            time.sleep(0.3)
        assert _threads(pid) < threads + 16, "a thread per connection"
        assert all(_closed(s) for s in slow), "a trickled handshake outlived the total handshake deadline"
        assert time.monotonic() - t0 < HANDSHAKE + 4.0
        assert all(_closed(s) for s in idle)  # refused at accept (the per-peer cap) or timed out
    finally:
        for s in slow + idle:
            s.close()
    # The worker serves a legitimate remote reader again.
    far = tc.Config.from_flat({"client.host_id": "elsewhere"})
    with tc.connect(cluster.address) as c, tc.connect(cluster.address, config=far) as remote:
        art = c.put(np.arange(1000, dtype=np.int64))
        far_art = remote.artifact(art.id)
        assert np.array_equal(far_art.tensor(like="numpy"), np.arange(1000))
        assert far_art.last_diagnostics is not None and far_art.last_diagnostics.transport == "tcp"
        c.delete(art.id)


def test_errors_never_echo_a_huge_key(cluster: LocalCluster) -> None:
    key = "k" * 1_000_000
    with tc.connect(cluster.address) as c:
        with pytest.raises(NotFound) as info:
            c.artifact(key)
        assert len(str(info.value)) < 1000
    peer = RawPeer(cluster.address)
    try:
        peer.hello()
        peer.send(GetArtifact(key_or_id=key), request_id=2)
        env, msg = peer.recv()
        assert env.kind == ERROR and len(msg.message) < 1000
    finally:
        peer.close()


def test_refused_connections_are_logged_at_a_bounded_rate(cluster: LocalCluster) -> None:
    log = Path(cluster.workers["w0"].log_path)
    before = log.read_text().count("refused a connection")
    for _ in range(60):
        with pytest.raises(Unauthenticated):
            tc.connect(cluster.address, token="wrong")
    time.sleep(0.2)
    logged = log.read_text().count("refused a connection") - before
    assert 1 <= logged <= 10, f"{logged} lines for 60 refusals"
