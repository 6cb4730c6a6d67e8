"""High-cardinality tensors: KV pages under a sharded index, with HRW shard homes, leases and fencing tokens."""

from tensorcast.kv.keys import KVLayout, page_keys, shard_of

__all__ = ["KVLayout", "page_keys", "shard_of"]
