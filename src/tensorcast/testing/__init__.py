"""Test support: real local clusters with leak checks, and raw-socket helpers for protocol tests.

Use from a test as ``with running_cluster(workers=2) as cluster: ...``: every process the cluster started is
stopped by PID when the block ends, and the block fails the test if shared-memory segments or processes were
left behind.
"""

from tensorcast.testing.cluster import leaked_segments, running_cluster, wait_shards_settled
from tensorcast.testing.raw import RawPeer

__all__ = ["RawPeer", "leaked_segments", "running_cluster", "wait_shards_settled"]
