"""Test support: real local clusters with leak checks, and raw-socket helpers for protocol tests.

Use from pytest via ``pytest_plugins = ["tensorcast.testing.fixtures"]``. Every process a fixture starts
is stopped by PID when the fixture ends, and the fixture fails the test if shared-memory segments or
processes were left behind.
"""

from tensorcast.testing.cluster import leaked_segments, running_cluster, wait_shards_settled
from tensorcast.testing.raw import RawPeer

__all__ = ["RawPeer", "leaked_segments", "running_cluster", "wait_shards_settled"]
