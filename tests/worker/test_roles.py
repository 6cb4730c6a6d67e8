"""The worker's role table (``worker.server.ROLES``): which services each role brings, in order, and the
storage role seen by the others only through ``StoragePort``."""

from __future__ import annotations

import inspect
import os
import uuid
from pathlib import Path

import pytest

from tensorcast.config import Config
from tensorcast.errors import InvalidArgument
from tensorcast.kv.home import ShardHome
from tensorcast.pool.segments import remove_stale_segments
from tensorcast.worker import gateway, loading
from tensorcast.worker.gateway import GatewayRole
from tensorcast.worker.instances import InstanceRegistry
from tensorcast.worker.loading import LoadingRole
from tensorcast.worker.roles import StoragePort
from tensorcast.worker.server import ROLES, Worker
from tensorcast.worker.storage import StorageRole


def _worker(tmp_path: Path, roles: tuple[str, ...]) -> Worker:
    prefix = f"tc-roles-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    config = Config.from_flat({"worker.roles": roles, "worker.data_dir": str(tmp_path), "worker.shm_prefix": prefix,
                               "worker.memory_capacity": 8 << 20, "worker.prefault_bytes": 0,
                               "kv.memory_capacity": 8 << 20})
    return Worker(config, "w0", "127.0.0.1:1")  # nothing is started: no address is dialled


@pytest.mark.parametrize(("roles", "kinds"), [
    (("basic",), [StorageRole, LoadingRole, InstanceRegistry]),
    (("gateway",), [StorageRole, LoadingRole, InstanceRegistry, GatewayRole]),  # basic is always on
    (("shard-home", "basic"), [StorageRole, LoadingRole, InstanceRegistry, ShardHome]),
    (("shard-home", "gateway"), [StorageRole, LoadingRole, InstanceRegistry, GatewayRole, ShardHome]),
])
def test_each_role_brings_its_services_in_the_table_s_order(tmp_path: Path, roles: tuple[str, ...],
                                                             kinds: list[type]) -> None:
    worker = _worker(tmp_path, roles)
    try:
        assert [type(s) for s in worker.services] == kinds
        assert (worker.gateway is not None) == ("gateway" in roles)
        assert (worker.kv_home is not None) == ("shard-home" in roles)
        assert worker.roles == tuple(sorted({"basic", *roles}))
    finally:
        worker.storage.store.close()
        remove_stale_segments(worker.parts.config.worker.shm_prefix)


def test_an_unknown_role_is_refused_naming_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="known: \\['basic', 'gateway', 'shard-home'\\]"):
        _worker(tmp_path, ("basic", "router"))
    assert list(ROLES) == ["basic", "gateway", "shard-home"]


def test_the_storage_role_is_a_storage_port_and_the_others_see_only_the_port() -> None:
    port = {n for n, _ in inspect.getmembers(StoragePort) if not n.startswith("_")} | \
        set(StoragePort.__annotations__)
    assert port <= {n for n in dir(StorageRole)} | set(inspect.signature(StorageRole).parameters) | \
        {"store", "trust", "devices"}
    for module in (loading, gateway):  # nothing of the storage role beyond its port
        source = inspect.getsource(module)
        assert "StorageRole" not in source and ".fetcher" not in source and ".data_server" not in source
        assert "gs.caller" not in source
