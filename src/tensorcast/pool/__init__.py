"""The tensor pool: memory tier in shared-memory segments, content-addressed and reference-counted."""

from tensorcast.pool.memory import MemoryPool
from tensorcast.pool.segments import Segment, map_private, map_shared
from tensorcast.pool.state import PoolState

__all__ = ["MemoryPool", "PoolState", "Segment", "map_private", "map_shared"]
