"""Highest-random-weight (rendezvous) hashing of shards onto shard homes (pure).

Every worker computes the same ranking from the same inputs, with no coordination: for shard s, workers
are ordered by ``HRW(s, worker) = xxh3_64("s/worker")``. The first k are the shard's candidates. Removing
a worker moves only the shards it ranked first for; adding one takes about 1/n of the shards.
"""

from __future__ import annotations

from collections.abc import Iterable

import xxhash

__all__ = ["assignment", "candidates", "score"]


def score(shard: int, worker_id: str) -> int:
    return int(xxhash.xxh3_64_intdigest(f"{shard}/{worker_id}".encode()))


def candidates(shard: int, workers: Iterable[str], k: int = 3) -> list[str]:
    return sorted(workers, key=lambda w: (score(shard, w), w), reverse=True)[:k]


def assignment(num_shards: int, workers: Iterable[str]) -> dict[int, str]:
    """The rank-0 candidate of every shard."""
    ws = list(workers)
    return {s: candidates(s, ws, 1)[0] for s in range(num_shards)} if ws else {}
