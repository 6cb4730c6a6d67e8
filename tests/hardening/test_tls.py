"""TLS on every port, against real processes: a cluster whose CA and certificates are made at run time serves
puts, reads across the data plane, worker-to-worker pulls and HTTPS; a plain-text peer of any port is refused,
a certificate from another CA does not verify, and with mutual TLS a caller without a certificate is refused."""

from __future__ import annotations

import socket
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

import tensorcast as tc
from tensorcast.certs import make_ca, make_cert
from tensorcast.cluster import LocalCluster
from tensorcast.config import Config
from tensorcast.errors import TensorCastError, Unauthenticated, Unavailable
from tensorcast.testing import RawPeer, running_cluster
from tensorcast.transport.registry import make_transport
from tensorcast.wire.connection import encode_envelope
from tensorcast.wire.frames import pack_header
from tensorcast.wire.messages import PROTOCOL_VERSION, DataHello, DataRequest, Hello
from tensorcast.wire.protocol import REQUEST

SECRET = "tls-test-secret"
MiB = 1 << 20


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with running_cluster(workers=2, hosts=2, token=SECRET, tls=True,
                         config={"wire.handshake_timeout": 3.0, "worker.prefault_bytes": 0}) as c:
        yield c


def _with(config: Config, **tls: object) -> Config:
    return msgspec.structs.replace(config, tls=msgspec.structs.replace(config.tls, **tls))


def _far(config: Config) -> Config:
    """A caller on another host: its reads take the data plane."""
    return msgspec.structs.replace(config, client=msgspec.structs.replace(config.client, host_id="elsewhere"))


def _data_address(cluster: LocalCluster, worker: str = "w0") -> str:
    return str(cluster.workers[worker].info["data_address"])  # type: ignore[index]


def test_every_port_serves_over_tls(cluster: LocalCluster) -> None:
    config = cluster.client_config()
    client = cluster.credential("client")
    data = np.arange(3 * MiB, dtype=np.uint8)
    with tc.connect(cluster.address, token=client, config=config) as c, \
            tc.connect(cluster.address, token=client, config=_far(config)) as far:
        art = c.put({"x": data}, key="tls")
        got = far.artifact("tls")
        assert np.array_equal(got.tensor("x", like="numpy"), data)
        assert got.last_diagnostics is not None and got.last_diagnostics.transport == "tcp"
        moved = c.prefetch("tls", "w1").result()  # worker to worker, over the TLS data plane
        assert moved.source == "w0" and moved.bytes_moved == data.nbytes
        c.delete(art.id)
    https = ssl.create_default_context(cafile=config.tls.ca_file)
    for name, url in cluster.metrics_urls.items():
        assert url.startswith("https://"), (name, url)
        assert urllib.request.urlopen(url + "/healthz", context=https, timeout=10).read() == b"ok\n"
        req = urllib.request.Request(url + "/metrics",
                                     headers={"Authorization": f"Bearer {cluster.credential('read-only')}"})
        assert b"tensorcast_" in urllib.request.urlopen(req, context=https, timeout=10).read()


def _closed_without_a_frame(address: str, first: bytes) -> bool:
    """``first`` sent in plain text; True when the server closed without a TensorCast frame in reply."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(first)
        got = b""
        try:
            while chunk := s.recv(4096):
                got += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    return not got.startswith(b"TC")


def test_plain_text_is_refused_on_every_port(cluster: LocalCluster) -> None:
    plain = Config()
    with pytest.raises(Unavailable, match="TLS"):
        tc.connect(cluster.address, token=SECRET, config=plain)
    for address in (cluster.gs_address, cluster.address):
        peer = RawPeer(address)
        try:
            with pytest.raises((ConnectionError, OSError)):
                peer.hello(SECRET)
        finally:
            peer.close()
    for address, hello in [(cluster.gs_address, Hello(protocol_version=PROTOCOL_VERSION)),
                           (cluster.address, Hello(protocol_version=PROTOCOL_VERSION)),
                           (_data_address(cluster), DataHello(protocol_version=PROTOCOL_VERSION))]:
        body = encode_envelope(1, REQUEST, "plain", None, hello)
        assert _closed_without_a_frame(address, pack_header(len(body), 0) + body), address
    transport = make_transport("tcp", plain.wire, token=SECRET, max_streams=1)
    try:
        with pytest.raises(TensorCastError):
            transport.fetch(_data_address(cluster), DataRequest(artifact_id="a", name="x"), memoryview(bytearray(8)))
    finally:
        transport.close()
    url = cluster.metrics_urls["gs"].replace("https://", "http://")
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(url + "/healthz", timeout=5).read()
    with tc.connect(cluster.address, token=SECRET, config=cluster.client_config()) as c:  # they serve on
        assert len([w for w in c.list_workers() if w.alive]) == 2


def test_a_certificate_from_another_ca_does_not_verify(cluster: LocalCluster, tmp_path: Path) -> None:
    other = make_ca(tmp_path, "other-ca")
    wrong = _with(cluster.client_config(), ca_file=str(other.cert))
    with pytest.raises(Unauthenticated, match="does not verify"):
        tc.connect(cluster.address, token=SECRET, config=wrong)
    transport = make_transport("tcp", wrong.wire, token=SECRET, max_streams=1, tls=wrong.tls)
    try:
        with pytest.raises(Unauthenticated, match="does not verify"):
            transport.fetch(_data_address(cluster), DataRequest(artifact_id="a", name="x"), memoryview(bytearray(8)))
    finally:
        transport.close()
    # The right CA, but a name the certificate does not carry.
    misnamed = _with(cluster.client_config(), server_name="not-in-the-certificate")
    with pytest.raises(Unauthenticated, match="does not verify"):
        tc.connect(cluster.address, token=SECRET, config=misnamed)


def test_mutual_tls_refuses_a_caller_without_a_certificate(tmp_path: Path) -> None:
    with running_cluster(workers=1, token=SECRET, tls=True,
                         config={"tls.require_client_cert": "true", "worker.prefault_bytes": 0}) as cluster:
        config = cluster.client_config()
        bare = _with(config, cert_file="", key_file="")
        with pytest.raises(Unavailable, match="client certificate"):
            tc.connect(cluster.address, token=SECRET, config=bare)
        transport = make_transport("tcp", bare.wire, token=SECRET, max_streams=1, tls=bare.tls)
        try:
            with pytest.raises(Unavailable):
                transport.fetch(_data_address(cluster), DataRequest(artifact_id="a", name="x"),
                                memoryview(bytearray(8)))
        finally:
            transport.close()
        # A certificate of another CA is refused as well; the cluster's own gets in.
        other = make_ca(tmp_path, "other-ca")
        stranger = make_cert(tmp_path, other, "stranger", ["localhost", "127.0.0.1"])
        with pytest.raises(Unavailable):
            tc.connect(cluster.address, token=SECRET,
                       config=_with(config, cert_file=str(stranger.cert), key_file=str(stranger.key)))
        with tc.connect(cluster.address, token=cluster.credential("client"), config=config) as c:
            art = c.put({"x": np.arange(8)})
            assert np.array_equal(c.artifact(art.id).tensor("x", like="numpy"), np.arange(8))
        assert "TLS handshake failed" in Path(cluster.workers["w0"].log_path).read_text()
