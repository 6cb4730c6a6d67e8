"""Where simulated KV lives: an instance's paged prefix cache, the shared store, and block keys.

Owns: ``extend_keys`` (a prompt's whole blocks named by chained hashes, reusing the previous turn's keys for
the prefix it shares), ``salt_keys`` / ``session_salt`` (the same blocks named privately to one session's stay on
an instance, for engines whose cache serves only the session that filled it), ``BlockCache`` (one instance's
KV: blocks held by running requests, reference counted, and cached blocks no request holds, evicted least
recently used — vLLM's automatic prefix caching) and
``SharedStore`` (the block keys published to TensorCast: every instance can fetch them). Pure bookkeeping on
integers; no clock, no costs.

Does not own: when blocks are acquired or released (``sim.engine``), what a fetch or a move costs
(``sim.cost``), or moving a session's blocks (``sim.cluster``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import xxhash

from tensorcast.errors import InvalidArgument

__all__ = ["BlockCache", "SharedStore", "extend_keys", "salt_keys", "session_salt"]

Tokens = npt.NDArray[np.int32]


def extend_keys(prompt: Tokens, block_tokens: int, prev_prompt: Tokens | None = None,
                prev_keys: Sequence[int] = ()) -> list[int]:
    """Chained 64-bit keys of ``prompt``'s whole blocks (key i names blocks 0..i). The leading whole blocks
    ``prompt`` shares with ``prev_prompt`` keep ``prev_keys``; only the rest is hashed (a turn's prompt
    usually extends the previous turn's)."""
    whole = len(prompt) // block_tokens
    common = 0
    if prev_prompt is not None and prev_keys:
        n = min(len(prev_keys), whole) * block_tokens
        same = np.asarray(prev_prompt[:n] == prompt[:n])
        common = (n if bool(same.all()) else int(np.argmin(same))) // block_tokens
    keys = list(prev_keys[:common])
    seed = keys[-1] if keys else 0
    data = np.ascontiguousarray(prompt[:whole * block_tokens], dtype=np.int32)
    for b in range(common, whole):
        seed = int(xxhash.xxh3_64_intdigest(data[b * block_tokens:(b + 1) * block_tokens].tobytes(), seed=seed))
        keys.append(seed)
    return keys


def session_salt(session_id: str, stay: int) -> int:
    """A non-zero salt naming one stay of a session on an instance (``stay`` counts its changes of instance):
    blocks salted with it match only that session's requests during that stay."""
    return int(xxhash.xxh3_64_intdigest(f"{session_id}/{stay}".encode())) | 1


def salt_keys(keys: Sequence[int], salt: int) -> Sequence[int]:
    """``keys`` as a cache private to ``salt`` names them (``salt`` 0: unchanged). XOR with a 64-bit salt: one
    to one, so a salted prefix still matches block by block."""
    return keys if not salt else [k ^ salt for k in keys]


class SharedStore:
    """Block keys published to TensorCast. Unbounded: the store is assumed large enough to keep every block
    an experiment publishes (its eviction is not modelled)."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()

    def publish(self, keys: Sequence[int]) -> None:
        self.blocks.update(keys)

    def extend_match(self, keys: Sequence[int], start: int) -> int:
        """How far past ``start`` blocks the leading blocks of ``keys`` are in the store (chained keys: a block
        is only usable if every block before it is)."""
        n = start
        while n < len(keys) and keys[n] in self.blocks:
            n += 1
        return n


class BlockCache:
    """One instance's KV blocks: ``capacity_blocks`` in all, shared by blocks that running requests hold
    (``held``: key -> requests holding it; plus ``reserved`` unnamed blocks for their outputs and partial
    blocks) and cached blocks nobody holds (``free``, least recently used first), which are evicted as room
    is needed. A request reserves its whole output at admission, so a running request is never preempted."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise InvalidArgument(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.held: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict()
        self.reserved = 0

    @property
    def used_blocks(self) -> int:
        """Blocks running requests hold (what an engine reports as KV in use; cached blocks count as free)."""
        return len(self.held) + self.reserved

    def match(self, keys: Sequence[int]) -> int:
        """Leading blocks of ``keys`` present here (held or cached)."""
        n = 0
        for key in keys:
            if key not in self.held and key not in self.free:
                break
            n += 1
        return n

    def fits(self, keys: Sequence[int], private_blocks: int) -> bool:
        """Whether a request holding ``keys`` and ``private_blocks`` more fits beside the running ones
        (cached blocks can all be evicted)."""
        new = sum(1 for key in keys if key not in self.held)
        return self.used_blocks + new + private_blocks <= self.capacity_blocks

    def acquire(self, keys: Sequence[int], private_blocks: int) -> None:
        """A request starts: it holds ``keys`` (cached ones are reused, missing ones computed or fetched)."""
        for key in keys:
            count = self.held.get(key)
            if count is None:
                self.free.pop(key, None)
                self.held[key] = 1
            else:
                self.held[key] = count + 1
        self.reserved += private_blocks
        self.evict()

    def release(self, keys: Sequence[int], private_blocks: int, extra: Sequence[int] = ()) -> None:
        """A request finished: its blocks stay cached, with ``extra`` (the blocks its output filled that a
        later prompt reuses). Inserted last block first, so a prefix is more recent than its extensions and
        eviction takes leaves before the prefixes they hang from."""
        self.reserved -= private_blocks
        self.insert(extra)
        for key in reversed(keys):
            count = self.held[key] - 1
            if count:
                self.held[key] = count
            else:
                del self.held[key]
                self.free[key] = None
        self.evict()

    def insert(self, keys: Sequence[int]) -> None:
        """Blocks that arrived from elsewhere (a hydrated session), cached and most recently used."""
        for key in reversed(keys):
            if key in self.held:
                continue
            self.free[key] = None
            self.free.move_to_end(key)
        self.evict()

    def evict(self) -> None:
        while self.free and self.used_blocks + len(self.free) > self.capacity_blocks:
            self.free.popitem(last=False)
