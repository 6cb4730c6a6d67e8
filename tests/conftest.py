from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest

import tensorcast as tc
from tensorcast.cluster import LocalCluster
from tensorcast.testing import running_cluster
from tensorcast.testing.etcd import EtcdCluster
from tensorcast.testing.tools import require_tool

# Tests write their checkpoints under the temporary directory: the workers they start may register them from
# there (weights.allowed_roots; tests of the roots themselves configure their own).
os.environ.setdefault("TENSORCAST_WEIGHTS_ALLOWED_ROOTS", tempfile.gettempdir())


@pytest.fixture(scope="session")
def shared_cluster() -> Iterator[LocalCluster]:
    """One two-worker cluster for tests that do not break anything."""
    with running_cluster(workers=2, memory_capacity="1GiB") as cluster:
        yield cluster


@pytest.fixture(scope="session")
def etcd_cluster() -> Iterator[EtcdCluster]:
    """A real 3-member etcd cluster on loopback (Debian etcd-server), stopped at the end of the session.
    Tests that kill members use one of their own."""
    require_tool("etcd", "etcd-server")
    with EtcdCluster(3) as cluster:
        yield cluster


@pytest.fixture()
def client(shared_cluster: LocalCluster) -> Iterator[tc.Client]:
    with tc.connect(shared_cluster.address) as c:
        yield c


@pytest.fixture()
def remote_client(shared_cluster: LocalCluster) -> Iterator[tc.Client]:
    """A client that believes it is on another host: every byte takes the network path."""
    config = tc.Config.from_flat({"client.host_id": "another-host"})
    with tc.connect(shared_cluster.address, config=config) as c:
        yield c
