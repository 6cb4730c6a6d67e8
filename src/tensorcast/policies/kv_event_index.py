"""What each engine instance and each shard home holds, learned from KV events in vLLM's format (pure).

Owns: applying ``KVEventBatch``es from named sources (``"instance:ID"``: an engine's own events, its GPU
cache and its connector's saves; ``"worker:ID"``: a shard home's pages, ``kv.events``) to per-source sets of
block hashes; the translation of a block hash into the token-chain key a router computes from a prompt
(``prefix_index.block_keys``), learned from the events that carry token ids (vLLM's ``BlockStored`` names the
block's tokens and its parent's hash, so the chain is rebuilt without vLLM's hash function; the pool's events,
which carry no tokens, are matched through the same hashes once an engine announced them); and the answer a
router needs: how many leading tokens of a prompt a source holds. ``AllBlocksCleared`` empties a source
(a restarted engine or home); ``forget`` does for one that died without saying so. Bounded: at most
``max_blocks`` translations, least recently announced first out. No sockets, no clock (``policies.event_feed``
feeds it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import xxhash

from tensorcast.errors import InvalidArgument

__all__ = ["EventIndex"]

Hash = bytes | int


class EventIndex:
    def __init__(self, block_size: int, max_blocks: int = 1 << 20) -> None:
        if block_size < 1 or max_blocks < 1:
            raise InvalidArgument(f"block_size and max_blocks must be >= 1, got {block_size}, {max_blocks}")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._key_of: OrderedDict[Hash, int] = OrderedDict()  # block hash -> token-chain key
        self._hashes_of: dict[int, set[Hash]] = {}  # token-chain key -> the hashes that name it
        self._held: dict[str, set[Hash]] = {}  # source -> block hashes it holds
        self.unchained = 0  # stored blocks whose tokens could not be chained (parent never seen)

    # ----------------------------------------------------------------- events in
    def apply(self, source: str, batch: Any) -> None:
        """Apply one ``KVEventBatch`` (ours or vLLM's classes) from ``source``."""
        for event in batch.events:
            kind = type(event).__name__
            if kind == "BlockStored":
                self._stored(source, event)
            elif kind == "BlockRemoved":
                held = self._held.get(source)
                if held:
                    held.difference_update(_hashes(event.block_hashes))
            elif kind == "AllBlocksCleared":
                self._held.pop(source, None)

    def forget(self, source: str) -> None:
        """``source`` is gone (a dead home, an instance that left): it holds nothing."""
        self._held.pop(source, None)

    def _stored(self, source: str, event: Any) -> None:
        hashes = _hashes(event.block_hashes)
        self._held.setdefault(source, set()).update(hashes)
        tokens = list(event.token_ids or ())
        size = event.block_size or 0
        if not tokens or size != self.block_size or len(tokens) != size * len(hashes):
            return  # nothing to chain (the pool's events; another block size)
        parent = event.parent_block_hash
        prev = 0
        if parent is not None:
            parent = bytes(parent) if isinstance(parent, bytes | bytearray | memoryview) else parent
            if parent not in self._key_of:
                self.unchained += len(hashes)
                return
            prev = self._key_of[parent]
        arr = np.asarray(tokens, dtype=np.int64)
        for i, h in enumerate(hashes):
            prev = int(xxhash.xxh3_64_intdigest(arr[i * size:(i + 1) * size].tobytes(), seed=prev))
            self._learn(h, prev)

    def _learn(self, h: Hash, key: int) -> None:
        old = self._key_of.pop(h, None)
        if old is not None and old != key:
            self._hashes_of.get(old, set()).discard(h)
        self._key_of[h] = key
        self._hashes_of.setdefault(key, set()).add(h)
        while len(self._key_of) > self.max_blocks:
            gone, k = self._key_of.popitem(last=False)
            names = self._hashes_of.get(k)
            if names is not None:
                names.discard(gone)
                if not names:
                    del self._hashes_of[k]

    # ----------------------------------------------------------------- answers
    def matched_tokens(self, source: str, keys: Sequence[int]) -> int:
        """Leading tokens (whole blocks) of a prompt with these token-chain keys that ``source`` holds."""
        held = self._held.get(source)
        if not held:
            return 0
        n = 0
        for key in keys:
            names = self._hashes_of.get(key)
            if not names or held.isdisjoint(names):
                break
            n += 1
        return n * self.block_size

    def best_of(self, sources: Iterable[str], keys: Sequence[int]) -> int:
        """The longest match among ``sources`` (e.g. the shard homes of one host)."""
        return max((self.matched_tokens(s, keys) for s in sources), default=0)

    def sources(self) -> list[str]:
        return list(self._held)

    def size(self, source: str) -> int:
        return len(self._held.get(source, ()))


def _hashes(raw: Iterable[Any]) -> list[Hash]:
    return [bytes(h) if isinstance(h, bytes | bytearray | memoryview) else int(h) for h in raw]
