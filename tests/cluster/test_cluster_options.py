"""``LocalCluster``'s options for more than one machine (checked without starting processes), and the etcd
cluster that tests start."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tensorcast.cluster import LocalCluster
from tensorcast.errors import InvalidArgument
from tensorcast.testing.etcd import EtcdCluster
from tensorcast.testing.tools import require_tool


def test_etcd_prefix_follows_the_data_directory(tmp_path: Path) -> None:
    a = LocalCluster(data_dir=tmp_path / "a", etcd="http://127.0.0.1:2379")
    again = LocalCluster(data_dir=tmp_path / "a", etcd=["http://127.0.0.1:2379"])
    other = LocalCluster(data_dir=tmp_path / "b", etcd="http://127.0.0.1:2379")
    assert a.etcd_prefix == again.etcd_prefix != other.etcd_prefix  # a restart on the same directory finds it
    assert a.etcd_prefix.startswith("/tensorcast/") and a.etcd_prefix.endswith("/")
    chosen = LocalCluster(data_dir=tmp_path / "a", etcd="http://127.0.0.1:2379",
                          config={"gs.etcd_prefix": "/mine/"})
    assert chosen.etcd_prefix == "/mine/"


def test_several_global_stores_need_etcd(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="etcd"):
        LocalCluster(data_dir=tmp_path, global_stores=2)
    with pytest.raises(InvalidArgument):
        LocalCluster(data_dir=tmp_path, global_stores=0, etcd="http://127.0.0.1:2379")


def test_etcd_cluster_starts_again_when_a_chosen_port_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ports are chosen before etcd binds them; another process can take one in between (it did in CI)."""
    require_tool("etcd", "etcd-server")
    from tensorcast.testing import etcd as etcd_module

    squatters: list[socket.socket] = []
    chosen = etcd_module.unused_port

    def taken_once() -> int:
        port = chosen()
        if not squatters:
            squatter = socket.socket()
            squatter.bind(("127.0.0.1", port))
            squatter.listen()
            squatters.append(squatter)
        return port

    monkeypatch.setattr(etcd_module, "unused_port", taken_once)
    try:
        with EtcdCluster(3) as cluster:
            squatted = squatters[0].getsockname()[1]
            assert squatted not in cluster.client_ports + cluster.peer_ports
            assert all(cluster.healthy(i) for i in range(3))
    finally:
        squatters[0].close()
