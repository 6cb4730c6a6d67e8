"""A bounded wire fuzz against real processes: over 20,000 frames — garbage, corrupted headers, mangled and
random valid messages, before and after the handshake — at the global store, a worker's RPC port and its data
port. Every answer is a well-formed frame (errors typed with a known code), no process dies, and memory stays
bounded."""

from __future__ import annotations

import socket
import struct
import typing
from collections.abc import Iterator

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorcast import errors
from tensorcast.cluster import LocalCluster
from tensorcast.testing import running_cluster
from tensorcast.wire.connection import encode_envelope
from tensorcast.wire.frames import CHECKSUMS, HEADER, MAGIC, pack_header
from tensorcast.wire.messages import PROTOCOL_VERSION, DataHello, DataRequest, ErrorReply, Hello
from tensorcast.wire.protocol import ERROR, REQUEST, Envelope, Message

FRAMES_PER_EXAMPLE = 60
EXAMPLES = 360  # 360 x 60 > 20,000 frames
CODES = {cls.code for cls in (errors.NotFound, errors.InvalidArgument, errors.DeadlineExceeded,
                              errors.Unauthenticated, errors.ResourceExhausted, errors.Unavailable,
                              errors.ChunkCorrupted, errors.StaleFencingToken, errors.InternalError)}
MESSAGES = typing.get_args(Message)
_ENV = msgspec.msgpack.Decoder(Envelope)
_MSG = msgspec.msgpack.Decoder(Message)
_ENC = msgspec.msgpack.Encoder()
sent = [0]


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    config = {"wire.handshake_timeout": 2.0, "wire.max_frame_bytes": 1 << 20, "worker.prefault_bytes": 0}
    with running_cluster(workers=1, config=config) as c:
        yield c


def _valid(message: msgspec.Struct, request_id: int = 1, deadline: float | None = None) -> bytes:
    body = encode_envelope(request_id, REQUEST, "fuzz", deadline, message)
    return pack_header(len(body), 0) + body


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
    return pack_header(len(body), 0) + body


@st.composite
def mangled(draw: st.DrawFn) -> bytes:
    """A valid frame with bytes flipped, cut or added, or a header that lies about the sizes."""
    base = draw(st.sampled_from([
        _valid(Hello(protocol_version=PROTOCOL_VERSION)), _valid(DataHello(protocol_version=PROTOCOL_VERSION)),
        _valid(DataRequest(artifact_id="tc-" + "0" * 32, name="x")), _valid(ErrorReply(code="X", message="y")),
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


frame = st.one_of(st.binary(min_size=1, max_size=96), random_message(), mangled(),
                  st.just(MAGIC + bytes([PROTOCOL_VERSION, 0]) + b"\xff" * 12))


def _check_replies(data: bytes) -> None:
    """Whatever came back is a sequence of well-formed frames; errors carry a known code."""
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


def _exchange(address: str, frames: list[bytes], handshake: bytes | None) -> None:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        out = (handshake or b"") + b"".join(frames)
        try:
            s.sendall(out)
            sent[0] += len(frames) + (handshake is not None)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            return  # refused and closed already
        s.settimeout(2.0)
        got = bytearray()
        try:
            while chunk := s.recv(65536):
                got += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    _check_replies(bytes(got))


def test_wire_fuzz_yields_typed_errors_only(cluster: LocalCluster) -> None:
    assert cluster.gs is not None
    pids = {"gs": cluster.gs.pid, "w0": cluster.workers["w0"].pid}
    before = {k: _rss(p) for k, p in pids.items()}
    data_address = cluster.workers["w0"].info["data_address"]  # type: ignore[index]
    ports = [(cluster.gs_address, _valid(Hello(protocol_version=PROTOCOL_VERSION))),
             (cluster.address, _valid(Hello(protocol_version=PROTOCOL_VERSION))),
             (data_address, _valid(DataHello(protocol_version=PROTOCOL_VERSION)))]

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(port=st.integers(0, 2), authenticated=st.booleans(),
           frames=st.lists(frame, min_size=FRAMES_PER_EXAMPLE, max_size=FRAMES_PER_EXAMPLE))
    def run(port: int, authenticated: bool, frames: list[bytes]) -> None:
        address, hello = ports[port]
        _exchange(address, frames, hello if authenticated else None)

    run()
    assert sent[0] >= 20_000, sent[0]
    for name, pid in pids.items():
        assert cluster.gs.alive() if name == "gs" else cluster.workers[name].alive(), f"{name} died"
        assert _rss(pid) - before[name] < 100 << 20, f"{name} grew by {(_rss(pid) - before[name]) >> 20} MiB"
    import tensorcast as tc  # and everything still works

    with tc.connect(cluster.address) as c:
        art = c.put({"ok": __import__("numpy").arange(3)})
        assert list(c.artifact(art.id).tensor("ok", like="numpy")) == [0, 1, 2]
