"""Global store: control-plane metadata (workers, artifacts, keys, replicas, leases), durable in a database."""

from tensorcast.gs.backend import MetadataBackend
from tensorcast.gs.service import GlobalStore, run_global_store
from tensorcast.gs.sqlite import SqliteBackend

__all__ = ["GlobalStore", "MetadataBackend", "SqliteBackend", "run_global_store"]
