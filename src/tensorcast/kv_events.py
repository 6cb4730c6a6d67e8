"""KV events in vLLM's format: what a shard home tells routers about the pages it holds (pure).

Owns: the event records, field for field and tag for tag those of vLLM's ``vllm.distributed.kv_events``
(``KVEventBatch`` of ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``, msgpack), so that vLLM's own
classes, and the routers built on them (llm-d's KV-cache indexer, Dynamo's KV router, the vLLM router), decode
them unchanged; the block hash a page key stands for (``block_hash_of``: a key of vLLM's tier namespace,
``integrations.vllm_block_keys``, carries vLLM's own block hash and group; any other key is published as its
UTF-8 bytes); and ``PageEvents``, the buffer a ``kv.pages.PageStore`` tells of every page committed and freed,
cut into one batch per turn of its owner's event loop. ``medium`` is ``"CPU"`` (the pool's memory) and
``ownership`` ``"tensorcast"``, the names vLLM gives a secondary tier's events. Does not own: sockets
(``kv.event_publisher``) or when pages come and go (``kv.pages``).
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

__all__ = ["MEDIUM", "OWNERSHIP", "AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEventBatch",
           "block_hash_of", "decode_batch", "encode_batch", "event_of"]

MEDIUM = "CPU"  # vLLM's Medium.CPU: the pool keeps pages in memory
OWNERSHIP = "tensorcast"  # vLLM's "secondary offloading tier identifier"

# A key of vLLM's tier namespace (integrations.vllm_block_keys.block_key): "vb/NAMESPACE/HASH/gGROUP[/...]".
_VLLM_KEY = re.compile(r"vb/[0-9a-f]{16}/([0-9a-f]{2,128})/g(\d{1,9})(?:/.*)?\Z")


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's ``KVCacheEvent``: a map tagged ``type`` with the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENC.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """``msgspec.ValidationError``/``DecodeError`` for anything but a batch."""
    return _DEC.decode(payload)


def block_hash_of(key: str) -> tuple[bytes, int | None]:
    """The block hash and KV-cache group a page key stands for: vLLM's own for a key of its tier namespace
    (so a router matches the pool's pages with the engines' own events), else the key's bytes."""
    m = _VLLM_KEY.match(key)
    if m is not None and len(m.group(1)) % 2 == 0:
        return bytes.fromhex(m.group(1)), int(m.group(2))
    return key.encode(), None


def event_of(kind: tuple[bool, int | None] | None, hashes: list[bytes | int]) -> BlockStored | BlockRemoved:
    """The event of a run of pages stored (``kind``: (True, group)) or removed (False, group)."""
    assert kind is not None
    stored, group = kind
    if stored:
        # The pool does not know a page's tokens: token_ids is empty and block_size 0 (vLLM's router keys on
        # the hashes; the tier namespace makes them the engines' own).
        return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
                           medium=MEDIUM, lora_name=None, group_idx=group, ownership=OWNERSHIP)
    return BlockRemoved(block_hashes=hashes, medium=MEDIUM, group_idx=group, ownership=OWNERSHIP)
