"""The smaller holes of hostile input, against real processes: each used to end in an untyped error, a stored
pointer, silently kept bytes, a terminal taken over or a page another site could read.

- lone surrogates in names and keys, views claiming terabytes (stride 0, a torch size past int64), slice
  step 0, object-dtype KV pages: ``InvalidArgument`` before anything is sent or copied;
- a ``PutData`` frame without its payload: a typed error reply, and the worker serves on;
- a KV put of other bytes (or another size) under a stored key: ``AlreadyExists``, the stored page kept;
  the same bytes again stay an idempotent no-op;
- escape sequences in worker ids never reach the terminal through ``tensorcast status``;
- the HTTP endpoints send security headers, and a token-less cluster answers only to its own Host names.
"""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import tensorcast as tc
from tensorcast.cluster import LocalCluster
from tensorcast.errors import AlreadyExists, InvalidArgument
from tensorcast.records import WorkerInfo
from tensorcast.testing import RawPeer, running_cluster
from tensorcast.wire.messages import ErrorReply, ListWorkers, PutData, RegisterWorker
from tensorcast.wire.protocol import ERROR

FAR = tc.Config.from_flat({"client.host_id": "elsewhere"})  # puts and gets take the network path
HUGE = 1 << 42  # 4 TiB


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with running_cluster(workers=1, memory_capacity="256MiB") as c:
        yield c


@pytest.fixture()
def client(cluster: LocalCluster) -> Iterator[tc.Client]:
    with tc.connect(cluster.address) as c:
        yield c


def test_lone_surrogates_in_names_and_keys_are_invalid_arguments(client: tc.Client) -> None:
    with pytest.raises(InvalidArgument, match="surrogate"):
        client.put({"a\ud800": np.arange(3)})
    with pytest.raises(InvalidArgument, match="surrogate"):
        client.put(np.arange(3), key="k\udc00")
    with pytest.raises(InvalidArgument, match="surrogate"):
        client.artifact("k\ud800")
    with pytest.raises(InvalidArgument, match="surrogate"):
        client.kv.put(["a\ud800"], [np.ones(32, np.uint8)])
    with pytest.raises(InvalidArgument, match="surrogate"):
        client.kv.get(["a\ud800"])
    assert client.put({"a": np.arange(3)}, key="k").tensor("a", like="numpy").tolist() == [0, 1, 2]


def test_views_claiming_more_than_memory_are_refused_before_any_copy(client: tc.Client) -> None:
    one = np.zeros(1, np.uint8)
    with pytest.raises(InvalidArgument, match="non-contiguous view"):
        client.put(np.lib.stride_tricks.as_strided(one, shape=(HUGE,), strides=(0,)))
    with pytest.raises(InvalidArgument, match="non-contiguous view"):
        client.put({"t": torch.zeros(1).expand(HUGE)})
    with pytest.raises(InvalidArgument, match="non-contiguous view"):
        client.put({"t": torch.zeros(1).expand(1 << 61)})  # 2**63 bytes: torch's own size overflows int64
    with pytest.raises(InvalidArgument, match=r"kv\.max_page_bytes"):
        client.kv.put(["stride-0"], [np.lib.stride_tricks.as_strided(one, shape=(HUGE,), strides=(0,))])
    small = np.lib.stride_tricks.as_strided(np.arange(4, dtype=np.int32), shape=(3, 4), strides=(0, 4))
    assert client.put(small).tensor(like="numpy").tolist() == [[0, 1, 2, 3]] * 3  # a small one is copied


def test_slice_step_zero_is_an_invalid_argument(client: tc.Client) -> None:
    art = client.put({"x": np.arange(10)})
    with pytest.raises(InvalidArgument, match="step"):
        art.view({"x": [(0, slice(None, None, 0))]})
    with pytest.raises(InvalidArgument, match="step"):
        art.prefetch("w0", slices={"x": [(0, slice(0, 5, 0))]}).result(timeout=30)
    with pytest.raises(InvalidArgument, match="step"):
        client.prefetch(art.id, "w0", slices={"x": [(0, slice(0, 5, 0))]}).result(timeout=30)


def test_put_data_without_payload_is_a_typed_error_and_the_worker_serves_on(cluster: LocalCluster) -> None:
    peer = RawPeer(cluster.address)
    try:
        peer.hello()
        peer.send(PutData(put_id="p" * 32, index=0, offset=0), request_id=10)  # no payload
        env, msg = peer.recv()
        assert env.kind == ERROR and isinstance(msg, ErrorReply) and msg.code == "INVALID_ARGUMENT", msg
        assert "payload" in msg.message
        peer.send(ListWorkers(), request_id=11)  # the same connection serves on
        env, _ = peer.recv()
        assert env.kind != ERROR
    finally:
        peer.close()
    with tc.connect(cluster.address) as c:
        assert c.put(np.arange(7)).tensor(like="numpy").tolist() == list(range(7))


def test_object_dtype_kv_pages_are_refused(client: tc.Client) -> None:
    with pytest.raises(InvalidArgument, match="object"):
        client.kv.put(["objects"], [np.array([object()] * 8, dtype=object)])
    with pytest.raises(InvalidArgument, match="object"):
        client.kv.put(["objects-list"], [[object(), object()]])
    assert client.kv.present(["objects", "objects-list"]) == [False, False]


@pytest.mark.parametrize("where", ["same-host", "remote"])
def test_a_kv_key_names_one_page(cluster: LocalCluster, where: str) -> None:
    page = np.random.default_rng().integers(0, 255, 4096, dtype=np.uint8)
    key = f"one-page-{where}-{page[:8].tobytes().hex()}"
    with tc.connect(cluster.address, config=FAR if where == "remote" else None) as c:
        assert c.kv.put([key], [page]) == 1
        assert c.kv.put([key], [page.copy()]) == 0  # the same bytes again: idempotent
        with pytest.raises(AlreadyExists, match="4096 bytes"):
            c.kv.put([key], [page[:100]])  # another size: refused before anything is received
        if where == "remote":  # bytes from another host are compared as they arrive
            other = page.copy()
            other[4000] ^= 1
            fresh = key + "-fresh"
            with pytest.raises(AlreadyExists, match="other bytes"):
                c.kv.put([fresh, key], [page, other])
            assert c.kv.present([fresh]) == [False]  # nothing of the refused request was kept
        got = c.kv.get([key])[0]
        assert got is not None and np.array_equal(got, page)


def test_http_responses_carry_security_headers_and_check_host(cluster: LocalCluster) -> None:
    urls = cluster.metrics_urls
    for name, path in [("gs", "/"), ("gs", "/api/state"), ("gs", "/metrics"), ("w0", "/metrics"), ("w0", "/nope")]:
        status, headers, _ = _get(urls[name], path)
        assert status in (200, 404), (name, path, status)
        assert headers["x-content-type-options"] == "nosniff"
        assert headers["referrer-policy"] == "no-referrer"
        csp = headers["content-security-policy"]
        assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp
        if path == "/":  # the dashboard runs only its own script and talks only to its origin
            assert "script-src 'sha256-" in csp and "connect-src 'self'" in csp and "unsafe" not in csp
    gs = urls["gs"]
    port = gs.rsplit(":", 1)[1]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost", f"LOCALHOST.:{port}"):
        assert _get(gs, "/api/state", host)[0] == 200, host
    for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.nip.io:{port}", f"[::2]:{port}"):
        status, _, body = _get(gs, "/api/state", host)
        assert status == 421 and b"workers" not in body, host  # a DNS-rebinding page reads nothing
        assert _get(urls["w0"], "/metrics", host)[0] == 421
    assert _get(gs, "/healthz", "evil.example")[0] == 200  # liveness tells nothing: open to any probe


def _get(url: str, path: str, host: str | None = None) -> tuple[int, dict[str, str], bytes]:
    hostport = url.split("//", 1)[1]
    conn = http.client.HTTPConnection(hostport, timeout=10)
    try:
        conn.putrequest("GET", path, skip_host=host is not None)
        if host is not None:
            conn.putheader("Host", host)
        conn.endheaders()
        reply = conn.getresponse()
        return reply.status, {k.lower(): v for k, v in reply.getheaders()}, reply.read()
    finally:
        conn.close()


def test_status_escapes_control_characters_in_peer_chosen_ids(cluster: LocalCluster) -> None:
    """Last in this module: it registers a worker that never heartbeats (no roles: nothing is placed on it)."""
    evil = "evil\x1b]0;owned\x07\x1b[2J\x1b[31m[red]x\u202e"
    peer = RawPeer(cluster.gs_address)
    try:
        peer.hello()
        info = WorkerInfo(worker_id=evil, address="127.0.0.1:1", host_id="h\x1b[1A", roles=())
        peer.send(RegisterWorker(worker=info), request_id=5)
        env, msg = peer.recv()
        assert env.kind != ERROR, msg
    finally:
        peer.close()
    env = {**os.environ, "TENSORCAST_ADDRESS": cluster.address, "COLUMNS": "400", "FORCE_COLOR": "1"}
    for args in (["status"], ["status", "--shards"]):
        out = subprocess.run([sys.executable, "-m", "tensorcast", *args], capture_output=True, text=True,
                             timeout=120, env=env)
        assert out.returncode == 0, out.stderr
        printed = _strip_our_styles(out.stdout)
        assert "\x1b]" not in printed and "\x07" not in printed and "\x1b[2J" not in printed, repr(printed)
        assert "\u202e" not in printed
        if args == ["status"]:
            assert "evil\\x1b]0;owned\\x07" in printed and "[red]x\\u202e" in printed, printed


def _strip_our_styles(text: str) -> str:
    """Output with rich's own SGR colour codes removed (FORCE_COLOR makes it style its tables): what is left of
    ESC can only have come from the data."""
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", text)
