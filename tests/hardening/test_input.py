"""Bad input gets a typed error, on the caller's side and (never trusting the caller) on the servers'; the
system keeps running with nothing lost."""

from __future__ import annotations

import math
import socket
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

import tensorcast as tc
from tensorcast.cluster import LocalCluster
from tensorcast.errors import InvalidArgument
from tensorcast.kv import KVLayout, page_keys
from tensorcast.limits import MAX_TTL, MIN_TTL
from tensorcast.testing import RawPeer
from tensorcast.wire.frames import pack_header
from tensorcast.wire.messages import PROTOCOL_VERSION, DataHello, DataRequest, ErrorReply, ListWorkers, PutBegin
from tensorcast.wire.protocol import ERROR

BAD_TTLS = [math.nan, math.inf, -math.inf, 1e300, 1e-9, 0, -1, MAX_TTL * 2, "5", True, None]


@pytest.mark.parametrize("ttl", BAD_TTLS[:-1])
def test_ttl_must_be_a_finite_number_of_seconds_within_bounds(client: tc.Client, ttl: object) -> None:
    with pytest.raises(InvalidArgument, match="ttl"):
        client.put(np.arange(3), ttl=ttl)  # type: ignore[arg-type]
    # Content of its own: a system-owned artifact with the same bytes (put by another test) would absorb the lease.
    leased = client.put(np.random.default_rng().integers(0, 2**62, 4), ttl=MIN_TTL + 29)
    with pytest.raises(InvalidArgument, match="ttl"):
        leased.renew(ttl)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="ttl"):
        leased.pin(on="w0", ttl=ttl)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="ttl"):
        client.kv.put([page_keys(list(range(16)), LAYOUT)[0]], [np.zeros(LAYOUT.page_bytes, np.uint8)],
                      ttl=ttl)  # type: ignore[arg-type]
    leased.release()


def test_the_servers_check_ttls_and_deadlines_too(shared_cluster: LocalCluster) -> None:
    meta = tc.TensorMeta(name="x", dtype="uint8", shape=(8,), nbytes=8, digest="0" * 64)
    peer = RawPeer(shared_cluster.address)
    try:
        peer.hello()
        for i, ttl in enumerate([math.nan, math.inf, 1e-9]):
            peer.send(PutBegin(tensors=(meta,), ttl=ttl), request_id=10 + i)
            env, msg = peer.recv()
            assert env.kind == ERROR and isinstance(msg, ErrorReply) and msg.code == "INVALID_ARGUMENT", msg
        peer.send(ListWorkers(), request_id=20, deadline=math.nan)
        env, msg = peer.recv()
        assert env.kind == ERROR and msg.code == "INVALID_ARGUMENT" and "deadline" in msg.message
        peer.send(ListWorkers(), request_id=21)  # the connection serves on
        env, _ = peer.recv()
        assert env.kind != ERROR
    finally:
        peer.close()


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -1.0, 1e300, "3"])
def test_timeouts_must_be_finite_numbers_within_bounds(client: tc.Client, timeout: object) -> None:
    with pytest.raises(InvalidArgument, match="timeout"):
        tc.context(timeout=timeout)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="timeout"):
        client.put(np.arange(3), timeout=timeout)  # type: ignore[arg-type]
    if timeout != 1e300:  # a memory TTL has no upper bound
        with pytest.raises(InvalidArgument):
            tc.Placement(disk="required", memory_ttl=timeout).validate()  # type: ignore[arg-type]


def test_tensors_that_cannot_be_stored_are_refused(client: tc.Client) -> None:
    sparse = torch.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (4,), check_invariants=True)
    with pytest.raises(InvalidArgument, match="to_dense"):
        client.put({"s": sparse})
    with warnings.catch_warnings():  # torch deprecates making quantized tensors; callers may still hold some
        warnings.simplefilter("ignore", UserWarning)
        quantized = torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)
    with pytest.raises(InvalidArgument, match="quantized"):
        client.put(quantized)
    with pytest.raises(InvalidArgument, match="like"):
        client.put(np.arange(3)).tensor(like="jax")


def test_reading_as_torch_without_torch_is_a_typed_error(shared_cluster: LocalCluster) -> None:
    code = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None  # as if it were not installed
        import numpy as np
        import tensorcast as tc
        from tensorcast.errors import InvalidArgument
        with tc.connect("{shared_cluster.address}") as c:
            art = c.put(np.arange(5))
            assert list(art.tensor(like="numpy")) == [0, 1, 2, 3, 4]
            try:
                art.tensor()  # like="torch" by default
            except InvalidArgument as exc:
                assert "like='numpy'" in str(exc), exc
                print("typed")
            c.delete(art.id)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "typed", out.stderr


LAYOUT = KVLayout("input-model", layers=2, kv_heads=2, head_dim=32, dtype="float16", page_size=16)


def test_kv_pages_must_fit_their_layout(client: tc.Client) -> None:
    keys = page_keys(list(range(3 * 16)), LAYOUT)
    good = [np.zeros(LAYOUT.page_bytes, np.uint8) for _ in keys]
    with pytest.raises(InvalidArgument, match="bytes, but a page of this layout"):
        client.kv.put(keys, [np.zeros(10, np.uint8)] * 3, layout=LAYOUT)
    shaped = np.zeros((2, 2, 2, 16, 32), np.float16)  # the right size, the wrong shape (K/V and heads swapped?)
    shaped = shaped.reshape(2, 2, 2, 32, 16)
    with pytest.raises(InvalidArgument, match="shape"):
        client.kv.put(keys[:1], [shaped], layout=LAYOUT)
    with pytest.raises(InvalidArgument, match=r"1\.\."):
        client.kv.put(keys[:1], [b""])  # no layout: still 1..kv.max_page_bytes
    with pytest.raises(InvalidArgument, match="buffer 0"):
        client.kv.get_into(keys[:1], [np.zeros(10, np.uint8)], layout=LAYOUT)
    page = np.zeros(LAYOUT.page_shape, np.float16)
    assert LAYOUT.page_bytes == page.nbytes
    client.kv.put(keys[:1], [page], layout=LAYOUT)
    client.kv.put(keys[1:], good[1:], layout=LAYOUT)


def test_malformed_data_plane_requests_get_typed_error_frames(shared_cluster: LocalCluster) -> None:
    data = shared_cluster.workers["w0"].info["data_address"]  # type: ignore[index]
    cases = [
        (DataRequest(artifact_id="tc-" + "0" * 32, name="x"), "NOT_FOUND"),
        (b"garbage!" * 8, "INVALID_ARGUMENT"),
        (pack_header(10, 5), "INVALID_ARGUMENT"),  # control frames carry no payload
        (PutBegin(tensors=()), "INVALID_ARGUMENT"),  # not a data-plane message
    ]
    for request, code in cases:
        peer = RawPeer(data)
        try:
            peer.send(DataHello(protocol_version=PROTOCOL_VERSION))
            assert peer.recv()[0].kind != ERROR
            if isinstance(request, bytes):
                peer.send_raw(request)
            else:
                peer.send(request)
            env, msg = peer.recv()
            assert env.kind == ERROR and isinstance(msg, ErrorReply) and msg.code == code, (request, msg)
        finally:
            peer.close()
    with socket.create_connection(tuple(data.rsplit(":", 1))) as s:  # type: ignore[arg-type]
        s.sendall(b"\0" * 64)  # garbage instead of a handshake
        s.settimeout(5)
        assert s.recv(65536)  # an error frame, then the close
