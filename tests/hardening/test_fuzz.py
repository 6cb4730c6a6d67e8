"""A bounded, seeded fuzz of every port of a real token-protected cluster: the global store's RPC port, a
worker's RPC and data ports, and the HTTP endpoints (metrics, dashboard, health) of both.

Frames of random bytes, corrupted and truncated headers, mangled and random valid messages and msgpack nested
thousands deep (in the envelope, in a message, in a field), sent before the handshake and after one made with
the cluster's token; HTTP requests with broken request lines, random paths, methods and headers, oversized or
cut short, with and without a credential. Every answer is a well-formed frame (errors typed with a known code)
or a well-formed HTTP response (never a 500); afterwards no process died, every server loop still serves a
normal put and get (the data plane too, through a reader on another host, and ``/healthz`` of each process),
and no process grew by more than ``RSS_BOUND`` (VmRSS, /proc/PID/status).
"""

from __future__ import annotations

import socket
import struct
import time
import typing
import urllib.request
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tensorcast as tc
from tensorcast import errors
from tensorcast.cluster import LocalCluster
from tensorcast.testing import RawPeer, running_cluster
from tensorcast.wire.connection import encode_envelope
from tensorcast.wire.frames import CHECKSUMS, HEADER, MAGIC, pack_header
from tensorcast.wire.messages import PROTOCOL_VERSION, DataHello, DataRequest, ErrorReply, Hello, PutBegin, PutData
from tensorcast.wire.protocol import ERROR, REQUEST, Envelope, Message

SECRET = "fuzz-cluster-secret-0123456789abcdef"
FRAMES_PER_EXAMPLE = 24
EXAMPLES = 200  # 200 x 24 = 4,800 frames at the three framed ports
HTTP_EXAMPLES = 120  # 120 x 4 = 480 HTTP requests
RSS_BOUND = 64 << 20
WALL_BOUND = 60.0  # seconds the fuzz itself may take (it takes ~20 s on a loaded 2-core host)
CODES = {cls.code for cls in (errors.NotFound, errors.AlreadyExists, errors.InvalidArgument,
                              errors.DeadlineExceeded, errors.PermissionDenied, errors.Unauthenticated,
                              errors.ResourceExhausted, errors.Unavailable, errors.ChunkCorrupted,
                              errors.StaleFencingToken, errors.VersionConflict, errors.SwapAborted)}
HTTP_STATUSES = {200, 400, 401, 404, 405, 421, 503}
MESSAGES = typing.get_args(Message)
FAR = tc.Config.from_flat({"client.host_id": "elsewhere"})  # reads take the data plane
_ENV = msgspec.msgpack.Decoder(Envelope)
_MSG = msgspec.msgpack.Decoder(Message)
_ENC = msgspec.msgpack.Encoder()
sent = {"frames": 0, "http": 0}


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    config = {"wire.handshake_timeout": 2.0, "wire.max_frame_bytes": 1 << 20, "worker.prefault_bytes": 0}
    with running_cluster(workers=1, token=SECRET, config=config, memory_capacity="256MiB") as c:
        yield c


def _framed(body: bytes, payload: bytes = b"") -> bytes:
    return pack_header(len(body), len(payload)) + body + payload


def _valid(message: msgspec.Struct, request_id: int = 1) -> bytes:
    return _framed(encode_envelope(request_id, REQUEST, "fuzz", None, message))


@st.composite
def random_message(draw: st.DrawFn) -> bytes:
    """A message of any type with fields drawn from what msgspec can encode, as a framed request."""
    cls = draw(st.sampled_from(MESSAGES))
    ints = st.integers(-(2**63), 2**63 - 1)
    fields = {}
    for name in cls.__struct_fields__:
        fields[name] = draw(st.one_of(st.none(), ints, st.floats(allow_nan=True), st.text(max_size=40),
                                      st.binary(max_size=40), st.lists(ints, max_size=4),
                                      st.dictionaries(st.text(max_size=8), ints, max_size=3)))
    raw = _ENC.encode({"type": cls.__name__, **fields})
    body = _ENC.encode([draw(st.integers(0, 2**32)), REQUEST, "fuzz", None, msgspec.Raw(raw)])
    return _framed(body)


@st.composite
def nested(draw: st.DrawFn) -> bytes:
    """msgpack nested 500..5000 deep (arrays, maps or both), as the message, inside a message's field, or in
    place of the envelope itself: what used to raise RecursionError in a server loop."""
    depth = draw(st.integers(500, 5000))
    opener = draw(st.sampled_from([b"\x91", b"\x81\xa1k", b"\x92\xc0"]))
    deep = opener * depth + b"\xc0"
    where = draw(st.sampled_from(["message", "field", "envelope"]))
    if where == "message":
        body = _ENC.encode(Envelope(1, REQUEST, "deep", None, msgspec.Raw(deep)))
    elif where == "field":
        body = _ENC.encode(Envelope(1, REQUEST, "deep", None,
                                    msgspec.Raw(b"\x82\xa4type\xa8PutBegin\xa7tensors" + deep)))
    else:
        body = deep
    return _framed(body)


@st.composite
def mangled(draw: st.DrawFn) -> bytes:
    """A valid frame with bytes flipped, cut or added, or a header that lies about the sizes or flags."""
    base = draw(st.sampled_from([
        _valid(Hello(protocol_version=PROTOCOL_VERSION)), _valid(DataHello(protocol_version=PROTOCOL_VERSION)),
        _valid(DataRequest(artifact_id="tc-" + "0" * 32, name="x")), _valid(ErrorReply(code="X", message="y")),
        _valid(PutBegin(tensors=())), _framed(encode_envelope(3, REQUEST, "f", None, PutData("p", 0, 0)), b"xy"),
    ]))
    kind = draw(st.sampled_from(["flip", "cut", "extend", "sizes", "flags"]))
    data = bytearray(base)
    if kind == "flip":
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= draw(st.integers(1, 255))
    elif kind == "cut":
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif kind == "extend":
        data += draw(st.binary(min_size=1, max_size=64))
    elif kind == "sizes":
        struct.pack_into("!IQ", data, 4, draw(st.integers(0, 2**32 - 1)), draw(st.integers(0, 2**40)))
    else:
        data[3] = draw(st.integers(0, 255)) or CHECKSUMS
    return bytes(data)


frame = st.one_of(st.binary(min_size=1, max_size=96), random_message(), mangled(), nested(),
                  st.just(MAGIC + bytes([PROTOCOL_VERSION, 0]) + b"\xff" * 12))


@st.composite
def http_request(draw: st.DrawFn) -> bytes:
    """An HTTP request, more or less: random bytes, or a request line and headers drawn to break the parser."""
    if draw(st.integers(0, 5)) == 0:
        return draw(st.binary(min_size=1, max_size=200))
    method = draw(st.sampled_from(["GET", "HEAD", "POST", "DELETE", "G\x00T", "GET GET", "", "\xff" * 8]))
    path = draw(st.one_of(st.sampled_from(["/", "/metrics", "/healthz", "/api/state", "/nope", "*", "//x"]),
                          st.text(max_size=40).map(lambda t: "/" + t)))
    version = draw(st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/9", ""]))
    headers = draw(st.lists(st.tuples(st.sampled_from(["Host", "Authorization", "X", "Content-Length", ""]),
                                      st.text(max_size=40)), max_size=4))
    if draw(st.booleans()):
        headers.append(("Authorization", f"Bearer {SECRET}"))
    if draw(st.integers(0, 15)) == 0:
        headers.append(("X-Big", "a" * 20_000))  # beyond the head limit
    head = f"{method} {path} {version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n"
    data = head.encode("utf-8", "surrogateescape")
    return data[: draw(st.integers(1, len(data)))] if draw(st.integers(0, 6)) == 0 else data


def _check_replies(data: bytes) -> None:
    """Whatever came back is a sequence of well-formed frames; errors carry a known code (never INTERNAL)."""
    pos = 0
    while len(data) - pos >= HEADER.size:
        magic, version, flags, body_len, payload_len = HEADER.unpack_from(data, pos)
        assert magic == MAGIC and version == PROTOCOL_VERSION, data[pos : pos + 16]
        end = pos + HEADER.size + body_len
        if end > len(data):
            return  # cut short by our own close
        env = _ENV.decode(data[pos + HEADER.size : end])
        if env.kind == ERROR:
            reply = _MSG.decode(env.body)
            assert isinstance(reply, ErrorReply) and reply.code in CODES, reply
        pos = end + payload_len + (8 * -(-payload_len // (4 << 20)) if flags & CHECKSUMS else 0)


def _drain(s: socket.socket, out: bytes) -> bytes:
    """Send ``out``, close our side, read until the server closes (or goes quiet for 2 s)."""
    got = bytearray()
    try:
        s.sendall(out)
        s.shutdown(socket.SHUT_WR)
    except OSError:
        return b""  # refused and closed already
    s.settimeout(2.0)
    try:
        while chunk := s.recv(65536):
            got += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return bytes(got)


def _exchange(address: str, frames: list[bytes], authenticate: bool, data: bool) -> None:
    peer = RawPeer(address)
    try:
        if authenticate:
            env, welcome = peer.hello(SECRET, data=data)
            assert env.kind != ERROR, welcome
        got = _drain(peer.sock, b"".join(frames))
        sent["frames"] += len(frames)
    finally:
        peer.close()
    _check_replies(got)


def _http(url: str, request: bytes) -> None:
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        got = _drain(s, request)
    sent["http"] += 1
    if got:  # a response, or nothing at all if our close came first: never a half-written or a 500
        assert got.startswith(b"HTTP/1.1 ") and int(got[9:12]) in HTTP_STATUSES, got[:200]


def _serves(cluster: LocalCluster) -> None:
    """Every process serves: a put and get through the worker's RPC port (which asks the global store), a read
    from another host (the worker's data plane), and every HTTP endpoint's /healthz and /metrics."""
    with tc.connect(cluster.address, token=SECRET) as c, \
            tc.connect(cluster.address, token=SECRET, config=FAR) as remote:
        data = np.random.default_rng().integers(0, 2**62, 4096)
        art = c.put({"ok": data})
        assert np.array_equal(c.artifact(art.id).tensor("ok", like="numpy"), data)
        assert np.array_equal(remote.artifact(art.id).tensor("ok", like="numpy"), data)
        assert [w.worker_id for w in c.list_workers() if w.alive] == ["w0"]
        c.delete(art.id)
    for url in cluster.metrics_urls.values():
        with urllib.request.urlopen(url + "/healthz", timeout=10) as reply:
            assert reply.status == 200
        request = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {SECRET}"})
        with urllib.request.urlopen(request, timeout=10) as reply:
            assert reply.status == 200 and b"tensorcast_" in reply.read()


def test_fuzz_every_port(cluster: LocalCluster) -> None:
    assert cluster.gs is not None
    pids = {"gs": cluster.gs.pid, "w0": cluster.workers["w0"].pid}
    _serves(cluster)  # warm: what a first put, read and scrape allocate is not growth
    before = {name: _rss(pid) for name, pid in pids.items()}
    data_address = cluster.workers["w0"].info["data_address"]  # type: ignore[index]
    ports = [(cluster.gs_address, False), (cluster.address, False), (data_address, True)]
    http_urls = list(cluster.metrics_urls.values())
    t0 = time.monotonic()

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(port=st.integers(0, 2), authenticate=st.booleans(),
           frames=st.lists(frame, min_size=FRAMES_PER_EXAMPLE, max_size=FRAMES_PER_EXAMPLE))
    def framed(port: int, authenticate: bool, frames: list[bytes]) -> None:
        address, data = ports[port]
        _exchange(address, frames, authenticate, data)

    @settings(max_examples=HTTP_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(which=st.integers(0, len(http_urls) - 1), requests=st.lists(http_request(), min_size=4, max_size=4))
    def http(which: int, requests: list[bytes]) -> None:
        for request in requests:
            _http(http_urls[which], request)

    framed()
    http()
    took = time.monotonic() - t0
    assert sent["frames"] >= EXAMPLES * FRAMES_PER_EXAMPLE and sent["http"] >= HTTP_EXAMPLES * 4, sent
    assert took < WALL_BOUND, f"the fuzz took {took:.1f} s"
    for name, pid in pids.items():
        assert cluster.gs.alive() if name == "gs" else cluster.workers[name].alive(), f"{name} died"
        grown = _rss(pid) - before[name]
        assert grown < RSS_BOUND, f"{name} grew by {grown >> 20} MiB"
    _serves(cluster)
