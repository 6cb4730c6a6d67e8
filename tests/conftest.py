from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

import tensorcast as tc
from tensorcast.cluster import LocalCluster
from tensorcast.testing import running_cluster
from tensorcast.testing.etcd import EtcdCluster
from tensorcast.testing.tools import require_tool

# Tests write their checkpoints under the temporary directory: the workers they start may register them from
# there (weights.allowed_roots; tests of the roots themselves configure their own).
os.environ.setdefault("TENSORCAST_WEIGHTS_ALLOWED_ROOTS", tempfile.gettempdir())


# What starts real processes: the shared fixtures, or a module that spawns its own (clusters, engines, etcd).
_PROCESS_FIXTURES = {"shared_cluster", "etcd_cluster", "client", "remote_client"}
_SPAWNS = re.compile(r"LocalCluster\(|running_cluster\(|EtcdCluster\(|subprocess\.|Popen\(|start_instance\(|"
                     r"instance_process|multiprocessing")


@cache
def _spawns(path: Path) -> bool:
    return bool(_SPAWNS.search(path.read_text()))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``processes`` every test that starts real processes (kill -9, SIGSTOP, sockets between them): the
    smaller set that the simulated cluster (``tensorcast.testing.sim``) does not replace. ``-m "not processes"``
    runs the rest, in-process, in a fraction of the time."""
    for item in items:
        if _PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())) or _spawns(Path(str(item.path))):
            item.add_marker(pytest.mark.processes)


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
