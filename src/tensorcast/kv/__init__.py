"""High-cardinality tensors: KV pages under a sharded index, with HRW shard homes, leases and fencing tokens."""

from tensorcast.kv.blocks import BlockRegions
from tensorcast.kv.keys import KVLayout, page_keys, shard_of, shards_of

__all__ = ["BlockRegions", "KVLayout", "page_keys", "shard_of", "shards_of"]
