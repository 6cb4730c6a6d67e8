"""An approximate, per-instance index of the prompt prefixes a router has sent to each instance.

Owns: cutting a prompt into blocks of ``block_size`` tokens, naming each block by a chained hash (a block's
key names the whole prefix up to and including it, so a set of keys is a prefix tree), remembering per
instance which keys it was sent, bounded by least-recently-used eviction, and answering "how many leading
tokens of this prompt did instance X see?". Pure bookkeeping fed what was routed where; no clock (recency
is the order of insertion), no I/O.

Does not own: what an engine really holds. Like SGLang's model gateway, the index is a guess built from
request history only — an instance may have evicted a prefix the index still lists, or hold one (fetched
from the shared store) the index never saw.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt
import xxhash

from tensorcast.errors import InvalidArgument

__all__ = ["PrefixIndex", "block_keys"]

Tokens = Sequence[int] | npt.NDArray[np.integer]


def block_keys(tokens: Tokens, block_size: int) -> list[int]:
    """Chained 64-bit keys of the prompt's whole blocks: key i hashes block i seeded with key i-1, so equal
    keys mean equal prefixes. A trailing partial block has no key (an engine cannot reuse it either)."""
    arr = np.ascontiguousarray(np.asarray(tokens, dtype=np.int64))
    keys: list[int] = []
    prev = 0
    for start in range(0, len(arr) - block_size + 1, block_size):
        prev = int(xxhash.xxh3_64_intdigest(arr[start:start + block_size].tobytes(), seed=prev))
        keys.append(prev)
    return keys


class PrefixIndex:
    """Per instance, the block keys of what was routed there, at most ``max_blocks`` each (LRU).

    An insert touches a prompt's keys from the last block back to the first, so a prefix is always more
    recent than its extensions and eviction drops leaves before the prefixes they hang from (the gateway
    also evicts least-recently-used leaves)."""

    def __init__(self, block_size: int = 16, max_blocks: int = 1 << 20) -> None:
        if block_size < 1:
            raise InvalidArgument(f"block_size must be >= 1, got {block_size}")
        if max_blocks < 1:
            raise InvalidArgument(f"max_blocks must be >= 1, got {max_blocks}")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def keys(self, tokens: Tokens) -> list[int]:
        return block_keys(tokens, self.block_size)

    def insert(self, instance_id: str, keys: Sequence[int]) -> None:
        """Record that a prompt with these block keys was sent to ``instance_id``."""
        blocks = self._blocks.setdefault(instance_id, OrderedDict())
        for key in reversed(keys):
            blocks[key] = None
            blocks.move_to_end(key)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def matched_tokens(self, instance_id: str, keys: Sequence[int]) -> int:
        """How many leading tokens of the prompt (whole blocks) ``instance_id`` was sent before."""
        blocks = self._blocks.get(instance_id)
        if not blocks:
            return 0
        n = 0
        for key in keys:
            if key not in blocks:
                break
            n += 1
        return n * self.block_size

    def longest_match(self, keys: Sequence[int], instance_ids: Iterable[str]) -> dict[str, int]:
        """Matched tokens per instance, for each of ``instance_ids``."""
        return {iid: self.matched_tokens(iid, keys) for iid in instance_ids}

    def size(self, instance_id: str) -> int:
        """Blocks indexed for ``instance_id``."""
        return len(self._blocks.get(instance_id, ()))

    def remove(self, instance_id: str) -> None:
        """Forget an instance (it left, or restarted with an empty cache)."""
        self._blocks.pop(instance_id, None)
