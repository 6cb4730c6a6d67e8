"""KV page identity: layouts, chained page keys, and the shard a key belongs to (pure).

Owns: ``KVLayout`` (what a page holds: layers, KV heads, head dim, dtype, tokens per page, and whether a layer
keeps K and V or, with multi-head latent attention, one latent per token; its ``layout_id``), ``page_keys``
(page i's key is the BLAKE3 hash of page i-1's key and page i's tokens, salted with the model id and layout id —
so a key names a whole prefix, and a prefix lookup is a walk of keys), what a key may be (``check_keys``: any
non-empty string up to ``MAX_KEY_BYTES``, so that engines keep their own keys — vLLM block hashes, SGLang's
hashes with rank suffixes, LMCache chunk keys) and ``shard_of`` (a hash of the key, so keys need not be uniform
themselves), for one key or a batch (``shards_of``, ``key_hashes``: the same 64-bit hash also names the key in a
home's presence table, ``kv.presence``).
Does not own: where pages live (``kv.home``) or how they are found (``client.kv``).
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import blake3
import msgspec
import numpy as np
import xxhash

from tensorcast.errors import InvalidArgument, clip
from tensorcast.tensors import numpy_dtype

__all__ = ["MAX_KEY_BYTES", "KVLayout", "PageKeyChain", "check_keys", "key_hash", "key_hash_array", "key_hashes",
           "page_keys", "shard_of", "shards_of"]

MAX_KEY_BYTES = 512

_ENC = msgspec.msgpack.Encoder()
_xxh3 = xxhash.xxh3_64_intdigest


@dataclass(frozen=True)
class KVLayout:
    """One page: ``page_size`` tokens' K and V for all ``layers`` of one model; with ``kind="mla"`` (multi-head
    latent attention, DeepSeek-style), each layer's one compressed latent per token (``head_dim``: the latent
    and its rotary part, e.g. 512 + 64), shared by every head, so no K/V pair and no heads axis."""

    model_id: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    kind: str = "mha"

    def __post_init__(self) -> None:
        numpy_dtype(self.dtype)
        if min(self.layers, self.kv_heads, self.head_dim, self.page_size) < 1:
            raise InvalidArgument(f"invalid KV layout {self}")
        if self.kind not in ("mha", "mla") or (self.kind == "mla" and self.kv_heads != 1):
            raise InvalidArgument(f"invalid KV layout {self}: kind is 'mha' or 'mla' (one latent: kv_heads=1)")

    @property
    def layout_id(self) -> str:
        doc: list[object] = [self.layers, self.kv_heads, self.head_dim, self.dtype, self.page_size]
        if self.kind != "mha":  # ids of existing layouts stay what they were
            doc.append(self.kind)
        return str(blake3.blake3(_ENC.encode(doc)).hexdigest())[:16]

    @property
    def page_bytes(self) -> int:
        """K and V (or the latent) of every layer for ``page_size`` tokens."""
        factor = 1 if self.kind == "mla" else 2 * self.kv_heads
        return factor * self.layers * self.head_dim * self.page_size * numpy_dtype(self.dtype).itemsize

    @property
    def page_shape(self) -> tuple[int, ...]:
        """The shape of a page as an array: (layers, K and V, kv_heads, page_size tokens, head_dim); for MLA
        (layers, page_size tokens, head_dim)."""
        if self.kind == "mla":
            return (self.layers, self.page_size, self.head_dim)
        return (self.layers, 2, self.kv_heads, self.page_size, self.head_dim)

    def check_page(self, nbytes: int, shape: tuple[int, ...] | None = None, what: str = "page") -> None:
        """``InvalidArgument`` unless a page of ``nbytes`` bytes (and, for an array of more than one
        dimension, of ``shape``) is one page of this layout."""
        if nbytes != self.page_bytes:
            raise InvalidArgument(f"{what}: {nbytes} bytes, but a page of this layout is {self.page_bytes} bytes "
                                  f"(shape {self.page_shape}, {self.dtype})")
        if shape is not None and len(shape) > 1 and tuple(shape) != self.page_shape:
            raise InvalidArgument(f"{what}: shape {tuple(shape)}, but a page of this layout is {self.page_shape}")


def page_keys(tokens: Sequence[int], layout: KVLayout) -> list[str]:
    """Keys of the full pages of ``tokens``: key i covers tokens ``[0, (i + 1) * page_size)``."""
    chain = PageKeyChain(layout)
    chain.extend(tokens)
    return chain.keys


class PageKeyChain:
    """``page_keys`` of a sequence that grows (a request decoding token by token): each ``extend`` hashes
    only the pages completed since the last one, so a long request costs O(pages) in all, not per step."""

    def __init__(self, layout: KVLayout) -> None:
        self.page_size = layout.page_size
        self.keys: list[str] = []
        self._prev = blake3.blake3(_ENC.encode([layout.model_id, layout.layout_id])).digest()

    def extend(self, tokens: Sequence[int]) -> list[str]:
        """Keys of the full pages of ``tokens`` (the whole sequence so far, whose first pages must be those
        hashed before); returns them all."""
        size = self.page_size
        for i in range(len(self.keys), len(tokens) // size):
            h = blake3.blake3(self._prev)
            h.update(_ENC.encode(list(tokens[i * size : (i + 1) * size])))
            self._prev = h.digest()
            self.keys.append(self._prev[:16].hex())
        return self.keys


def key_hash(key: str) -> int:
    """A key's 64-bit hash (XXH3 of its UTF-8 bytes): its shard, and its name in a presence table."""
    try:
        return _xxh3(key.encode())
    except UnicodeEncodeError:
        raise InvalidArgument(f"page keys must be valid UTF-8: {clip(key)} holds a lone surrogate") from None


def key_hashes(keys: Sequence[str]) -> list[int]:
    """``key_hash`` of every key, in one pass without a Python frame per key (batches run it per call)."""
    try:
        return list(map(_xxh3, map(str.encode, keys)))
    except UnicodeEncodeError:
        raise InvalidArgument(f"page keys must be valid UTF-8: {_not_utf8(keys)} holds a lone surrogate") from None


def key_hash_array(keys: Sequence[str]) -> np.ndarray[Any, Any]:
    """``key_hashes`` as a uint64 array (straight into a C array: no list of Python ints in between)."""
    try:
        return np.frombuffer(array.array("Q", map(_xxh3, map(str.encode, keys))), np.uint64)
    except UnicodeEncodeError:
        raise InvalidArgument(f"page keys must be valid UTF-8: {_not_utf8(keys)} holds a lone surrogate") from None


def _not_utf8(keys: Sequence[str]) -> str:
    """Which key cannot be encoded (for the error message; the fast paths above do not say)."""
    for i, key in enumerate(keys):
        try:
            key.encode()
        except UnicodeEncodeError:
            return f"key {i} ({clip(key)})"
    return "a key"


def shard_of(key: str, num_shards: int) -> int:
    """The shard a page key belongs to: a 64-bit hash of the key (XXH3), so keys of any shape spread evenly."""
    return key_hash(key) % num_shards


def shards_of(keys: Sequence[str], num_shards: int) -> list[int]:
    """``shard_of`` of every key (a batch's shards, computed once per call by clients and homes)."""
    return [h % num_shards for h in key_hashes(keys)]


def check_keys(keys: Sequence[str]) -> None:
    """``InvalidArgument`` unless every key is a non-empty ``str`` of at most ``MAX_KEY_BYTES`` bytes (UTF-8)."""
    if keys and {*map(type, keys)} == {str} and "" not in keys and max(map(len, keys)) <= MAX_KEY_BYTES // 4:
        return  # the common case, decided without a Python step per key (a lookup runs this per call)
    for i, key in enumerate(keys):
        if type(key) is not str:
            raise InvalidArgument(f"key {i}: page keys are str, got {type(key).__name__}")
        if not key or (len(key) > MAX_KEY_BYTES // 4 and len(key.encode()) > MAX_KEY_BYTES):
            raise InvalidArgument(f"key {i} ({clip(key)}): page keys are 1..{MAX_KEY_BYTES} bytes")
