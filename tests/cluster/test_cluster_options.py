"""``LocalCluster``'s options for more than one machine, checked without starting processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tensorcast.cluster import LocalCluster
from tensorcast.errors import InvalidArgument


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
