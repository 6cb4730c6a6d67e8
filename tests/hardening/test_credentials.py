"""Credentials with roles, and a handshake that does not replay, against real processes.

A cluster's processes hold the worker credential (not the secret); a client credential cannot register a
worker, take shard leases or send a shard home's copies; a read-only one reads and lists but neither writes
nor deletes; a handshake recorded off the wire (by a proxy between a real client and the gateway, or a raw
peer on the data port) is refused when played again on a new connection."""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

import tensorcast as tc
from tensorcast.checksums import CHUNK_BYTES
from tensorcast.cluster import LocalCluster
from tensorcast.errors import PermissionDenied
from tensorcast.records import WorkerInfo, WorkerLoad
from tensorcast.testing import RawPeer, running_cluster
from tensorcast.wire.frames import CHECKSUMS, HEADER
from tensorcast.wire.kv_messages import AcquireShards, KVReplicate
from tensorcast.wire.messages import (
    Challenge,
    DataReply,
    ErrorReply,
    Heartbeat,
    ListArtifacts,
    ListWorkers,
    RegisterWorker,
    Welcome,
    WorkerList,
)
from tensorcast.wire.protocol import ERROR, RESPONSE, Envelope, Message

SECRET = "credentials-test-secret"
_ENV = msgspec.msgpack.Decoder(Envelope)
_MSG = msgspec.msgpack.Decoder(Message)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with running_cluster(workers=1, token=SECRET, config={"wire.handshake_timeout": 3.0}) as c:
        yield c


def _denied(peer: RawPeer, message: msgspec.Struct, request_id: int, payload: bytes = b"") -> str:
    peer.send(message, request_id=request_id, payload=payload)
    env, reply = peer.recv()
    assert env.request_id == request_id and env.kind == ERROR and isinstance(reply, ErrorReply), reply
    return reply.code


def test_the_clusters_processes_hold_the_worker_credential(cluster: LocalCluster) -> None:
    """A worker and the global store run on the worker credential alone, and serve."""
    assert cluster.gs is not None
    for pid in (cluster.gs.pid, cluster.workers["w0"].pid):
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        assert env[b"TENSORCAST_TOKEN"] == cluster.credential("worker").encode()
        assert SECRET.encode() not in env.values()
    with tc.connect(cluster.address, token=cluster.credential("worker")) as c:
        assert [w.worker_id for w in c.list_workers() if w.alive] == ["w0"]


def test_a_client_credential_cannot_do_what_only_workers_do(cluster: LocalCluster) -> None:
    client = cluster.credential("client")
    with tc.connect(cluster.address, token=client) as c:  # its own work it may do
        art = c.put({"x": np.arange(10)}, key="client-key")
        assert np.array_equal(c.artifact("client-key").tensor("x", like="numpy"), np.arange(10))
        c.delete("client-key")
        assert c.kv.put(["kv-a"], [np.ones(16, dtype=np.uint8)]) == 1
    fake = WorkerInfo(worker_id="fake", address="127.0.0.1:1", host_id="h", roles=("basic", "gateway"))
    gs = RawPeer(cluster.gs_address)
    worker = RawPeer(cluster.address)
    try:
        assert isinstance(gs.hello(client)[1], Welcome)
        assert _denied(gs, RegisterWorker(worker=fake), 3) == "PERMISSION_DENIED"
        assert _denied(gs, AcquireShards(worker_id="fake", shards=(0, 1), ttl=3.0), 4) == "PERMISSION_DENIED"
        assert _denied(gs, Heartbeat(worker_id="w0", incarnation=1, load=WorkerLoad(memory_capacity=1)),
                       5) == "PERMISSION_DENIED"
        assert isinstance(worker.hello(client)[1], Welcome)
        copy = KVReplicate(worker_id="fake", tokens={0: 1 << 40}, keys=("k",), sizes=(4,), ttls=(60.0,))
        assert _denied(worker, copy, 6, payload=b"abcd") == "PERMISSION_DENIED"
        worker.send(ListWorkers(), request_id=7)  # the connection serves on, and nothing was registered
        env, reply = worker.recv()
        assert env.kind == RESPONSE and isinstance(reply, WorkerList)
        assert [w.worker_id for w in reply.workers] == ["w0"]
    finally:
        gs.close()
        worker.close()
    del art


def test_a_read_only_credential_reads_but_neither_writes_nor_deletes(cluster: LocalCluster) -> None:
    with tc.connect(cluster.address, token=cluster.credential("client")) as writer:
        art = writer.put({"x": np.arange(100, dtype=np.int64)}, key="shared")
        writer.kv.put(["kv-ro"], [np.full(16, 7, dtype=np.uint8)])
    far = tc.Config.from_flat({"client.host_id": "elsewhere"})  # reads take the data plane
    with tc.connect(cluster.address, token=cluster.credential("read-only")) as ro, \
            tc.connect(cluster.address, token=cluster.credential("read-only"), config=far) as remote:
        assert np.array_equal(ro.artifact("shared").tensor("x", like="numpy"), np.arange(100))
        assert np.array_equal(remote.artifact("shared").tensor("x", like="numpy"), np.arange(100))  # data plane
        assert "shared" in [a.key for a in ro.ls()]
        assert ro.kv.exists(["kv-ro"]) == 1
        assert np.array_equal(np.frombuffer(bytes(ro.kv.get(["kv-ro"])[0]), np.uint8), np.full(16, 7))
        with pytest.raises(PermissionDenied):
            ro.put({"y": np.zeros(4)}, key="nope")
        with pytest.raises(PermissionDenied):
            ro.delete("shared")
        with pytest.raises(PermissionDenied):
            ro.delete(art.id)
        with pytest.raises(PermissionDenied):
            ro.kv.put(["kv-no"], [np.zeros(16, dtype=np.uint8)])
    with tc.connect(cluster.address, token=cluster.credential("client")) as writer:
        assert writer.artifact("shared").id == art.id  # nothing was deleted
        writer.delete(art.id)


class _Recorder:
    """A proxy between one client and a server that keeps what the client sent."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.sent = bytearray()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        conn, _ = self.listener.accept()
        host, port = self.target.rsplit(":", 1)
        upstream = socket.create_connection((host, int(port)))
        with conn, upstream:
            while not self._stop.is_set():
                ready, _, _ = select.select([conn, upstream], [], [], 0.1)
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    if s is conn:
                        self.sent += data
                        upstream.sendall(data)
                    else:
                        conn.sendall(data)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.listener.close()


def _frames(data: bytes) -> list[tuple[Envelope, object]]:
    out, pos = [], 0
    while len(data) - pos >= HEADER.size:
        _magic, _version, flags, body_len, payload_len = HEADER.unpack_from(data, pos)
        env = _ENV.decode(data[pos + HEADER.size : pos + HEADER.size + body_len])
        out.append((env, _MSG.decode(env.body)))
        sums = 8 * -(-payload_len // CHUNK_BYTES) if flags & CHECKSUMS else 0
        pos += HEADER.size + body_len + sums + payload_len
    return out


def _replay(address: str, hello: bytes, rest: bytes) -> list[tuple[Envelope, object]]:
    """A recorded ``Hello`` on a new connection, and once answered, the rest of the recording; every frame that
    came back until the server closed the connection."""
    host, port = address.rsplit(":", 1)
    got = bytearray()
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(hello)
        while len(_frames(bytes(got))) < 1:
            got += s.recv(65536)
        with contextlib.suppress(OSError):
            s.sendall(rest)
        deadline = time.monotonic() + 5
        with contextlib.suppress(OSError):
            while time.monotonic() < deadline and (chunk := s.recv(65536)):
                got += chunk
    return _frames(bytes(got))


def test_a_recorded_handshake_does_not_replay(cluster: LocalCluster) -> None:
    recorder = _Recorder(cluster.address)
    try:
        with tc.connect(recorder.address, token=SECRET) as c:
            c.put({"x": np.arange(3)}, key="replayed")
            assert [a.key for a in c.ls("replayed")] == ["replayed"]
    finally:
        recorder.close()
    recorded = bytes(recorder.sent)
    sent = _frames(recorded)
    assert type(sent[0][1]).__name__ == "Hello" and type(sent[1][1]).__name__ == "Proof"
    assert any(isinstance(m, ListArtifacts) for _, m in sent)
    hello_end = HEADER.size + HEADER.unpack_from(recorded)[3]
    replies = _replay(cluster.address, recorded[:hello_end], recorded[hello_end:])
    kinds = [type(m).__name__ for _, m in replies]
    # A fresh challenge, then the recorded proof refused and the connection closed: no request was served.
    assert kinds[0] == "Challenge" and kinds[1:] == ["ErrorReply"], kinds
    assert isinstance(replies[1][1], ErrorReply) and replies[1][1].code == "UNAUTHENTICATED"
    with tc.connect(cluster.address, token=SECRET) as c:
        c.delete("replayed")


def test_a_recorded_data_plane_handshake_does_not_replay(cluster: LocalCluster) -> None:
    data = str(cluster.workers["w0"].info["data_address"])  # type: ignore[index]
    first = RawPeer(data)
    try:
        env, reply = first.hello(cluster.credential("client"), data=True)
        assert env.kind == RESPONSE and isinstance(reply, DataReply)
    finally:
        first.close()
    again = RawPeer(data)
    try:
        again.send_raw(first.sent[0])  # the recorded DataHello: a new challenge
        env, challenge = again.recv()
        assert isinstance(challenge, Challenge)
        again.send_raw(first.sent[1])  # the recorded proof
        env, reply = again.recv()
        assert env.kind == ERROR and isinstance(reply, ErrorReply) and reply.code == "UNAUTHENTICATED"
        assert again.closed_by_peer()
    finally:
        again.close()
