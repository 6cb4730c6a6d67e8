"""Page keys named by vLLM's own block hashes: what the vLLM tier and connector agree on (pure, no vLLM import).

A key is ``vb/NAMESPACE/HASH/gGROUP``: vLLM's block hash (hex; sha256 by default, the same on every instance,
since vLLM seeds its chain with a fixed value) and KV-cache group, inside a namespace that is the hash of
everything that decides a block's bytes — the model, the cache dtype, each group's tokens per block and
layers, the bytes and tokens of one stored unit, the parallel layout and vLLM's canonical page format when
one is used (``TENSORCAST_FORMAT``: the pages of ``TensorCastConnector``, per layer K then V, each heads x
tokens x head dim, layers in order — also vLLM's canonical page of a split-KV HND backend). Two engines
whose blocks are byte-compatible share a namespace, and only they do. A unit larger than one page
(``kv.max_page_bytes``) is stored as parts ``KEY/pN``. ``BlockHashChain`` names a request's pages this way
for the connector (``page_keys="block-hash"``). ``tensorcast.kv_events`` publishes these keys'
pages with vLLM's hash and group, so a router matches the pool's blocks with the engines' own events.
Does not own: vLLM's hashing (the engine computes the hashes) or any bytes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import blake3

from tensorcast.errors import InvalidArgument

__all__ = ["TENSORCAST_FORMAT", "BlockHashChain", "BlockNamespace", "block_key", "page_namespace", "part_keys"]

TENSORCAST_FORMAT = "tensorcast/layer-kv-heads-tokens-dim"


@dataclass(frozen=True)
class BlockNamespace:
    """What decides the bytes of one stored unit of KV (a chunk of ``blocks_per_chunk`` blocks of every layer
    of every rank), and so which engines can share it."""

    model: str
    dtype: str
    groups: tuple[tuple[int, int], ...]  # (tokens per block, layers) per KV-cache group
    unit_bytes: int
    blocks_per_unit: int = 1
    tp: int = 1
    pp: int = 1
    canonical_format: str = ""

    def __post_init__(self) -> None:
        if self.unit_bytes < 1 or self.blocks_per_unit < 1 or not self.groups or min(self.tp, self.pp) < 1:
            raise InvalidArgument(f"invalid block namespace {self}")

    @property
    def id(self) -> str:
        doc = [self.model, self.dtype.removeprefix("torch."), [list(g) for g in self.groups], self.unit_bytes,
               self.blocks_per_unit, self.tp, self.pp, self.canonical_format]
        return blake3.blake3(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()[:16]


def block_key(namespace_id: str, block_hash: bytes, group: int = 0) -> str:
    """The page key of one unit named by vLLM's block hash (``bytes``) and group."""
    if not block_hash or len(block_hash) > 64 or group < 0:
        raise InvalidArgument(f"a vLLM block hash is 1..64 bytes with a group >= 0, got {len(block_hash)} "
                              f"bytes, group {group}")
    return f"vb/{namespace_id}/{block_hash.hex()}/g{group}"


def part_keys(key: str, nbytes: int, max_page_bytes: int) -> list[tuple[str, int, int]]:
    """``(key, start, stop)`` of each part a unit of ``nbytes`` is stored as: itself when it fits one page."""
    if nbytes <= max_page_bytes:
        return [(key, 0, nbytes)]
    return [(f"{key}/p{i}", a, min(a + max_page_bytes, nbytes))
            for i, a in enumerate(range(0, nbytes, max_page_bytes))]



def page_namespace(model: str, dtype: str, block_size: int, layers: int, page_bytes: int) -> BlockNamespace:
    """The namespace of ``TensorCastConnector``'s pages (one block of every layer, ``TENSORCAST_FORMAT``)."""
    return BlockNamespace(model=model, dtype=dtype, groups=((block_size, layers),), unit_bytes=page_bytes,
                          canonical_format=TENSORCAST_FORMAT)


class BlockHashChain:
    """A request's page keys from vLLM's block hashes, read as the request grows (``hashes`` returns the
    request's ``block_hashes``, one per full block): the same interface as ``kv.keys.PageKeyChain``."""

    def __init__(self, namespace_id: str, hashes: Callable[[], Sequence[bytes]], page_size: int) -> None:
        self.namespace_id = namespace_id
        self.page_size = page_size
        self._hashes = hashes
        self.keys: list[str] = []

    def extend(self, tokens: Sequence[int]) -> list[str]:
        """Keys of the full pages of ``tokens`` that vLLM has hashed (all of them, once it has)."""
        hashes = self._hashes()
        for h in hashes[len(self.keys) : len(tokens) // self.page_size]:
            self.keys.append(block_key(self.namespace_id, bytes(h)))
        return self.keys
