"""A caller's side of a same-host home's presence table (``kv.presence``): mapped read-only, asked in batches.

Owns: mapping the anchor once and the current table segment again after each rebuild (checked against its
header before use), the vectorized probe of a batch (each key's home bucket and the next in one gather, the
rare rest bucket by bucket), and the vouching rule: an answer only when the lease table's sequence and the
anchor's generation held still across the probe, the anchor is still linked, and the clocks compare; per key,
only for a shard held under the caller's token and before the home's serve-until.
Does not own: the layout (``kv.presence``), writing (``kv.presence_writer``), or which tables a caller maps
and what it does with keys nobody vouched for (``client.kv_local``, ``client.kv``).
"""

from __future__ import annotations

import math
import mmap
import os
import time
from typing import Any

import numpy as np

from tensorcast.kv.presence import (
    ANCHOR_BYTES,
    ANCHOR_MAGIC,
    BUCKET,
    CAP,
    EMPTY,
    FOLD,
    GEN,
    GOLDEN,
    GOLDEN_U64,
    HEADER,
    MASK64,
    SEQ,
    SHARDS,
    TABLE_MAGIC,
    Table,
    bucket_shift,
    table_bytes,
)

__all__ = ["PresenceReader"]

_READ_ROUNDS = 8  # a reader leaves a key to its home past 8 buckets (two full buckets in a row are rare)


def _open(path: str) -> mmap.mmap:
    fd = os.open(path, os.O_RDONLY)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def _search_on(t: Table, h: int) -> float | None:
    """A key whose home bucket and the next are full without it: searched on, bucket by bucket (scalar: such
    keys are few). Its expiry; None: absent; NaN: not decided within ``_READ_ROUNDS`` buckets."""
    last = t.pairs.shape[0] - 1
    home = ((h * GOLDEN) & MASK64) >> bucket_shift(last)
    end = min(home + _READ_ROUNDS, last + 1)
    for b in range(home + 2, end):
        row = t.words[2 * BUCKET * b : 2 * BUCKET * (b + 1) : 2].tolist()
        if h in row:
            return float(t.floats[2 * (BUCKET * b + row.index(h)) + 1])
        if EMPTY in row:
            return None
    return None if end == last + 1 else math.nan  # nothing is stored past the spill bucket


class PresenceReader:
    """A same-host home's presence table, mapped read-only: the anchor once, the table again after each
    rebuild. Safe to use from several threads (a remap replaces the mapping; nothing is mutated in place)."""

    def __init__(self, path: str) -> None:
        self.path = path
        # Kept open: once the anchor is unlinked (its home restarted, or was cleaned up after dying) nothing
        # it says is trusted, since a restarted home may hold the same leases again without those pages.
        self._fd = os.open(path, os.O_RDONLY)
        try:
            mm = mmap.mmap(self._fd, os.fstat(self._fd).st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            anchor = memoryview(mm).cast("Q")
            if len(anchor) * 8 < ANCHOR_BYTES or anchor[0] != ANCHOR_MAGIC:
                raise ValueError(f"{path} is not a presence table")
        except BaseException:
            os.close(self._fd)
            raise
        self._anchor = anchor
        self._t: Table | None = None

    def _table(self) -> Table | None:
        gen = self._anchor[1]
        t = self._t
        if t is not None and t.generation == gen:
            return t
        if gen == 0:  # the home closed it
            return None
        path = f"{self.path}-{gen}"
        try:
            mm = _open(path)
        except OSError:  # rebuilt again meanwhile, or gone with its home
            return None
        header = memoryview(mm)[: HEADER * 8].cast("Q")
        cap, shards = header[CAP], header[SHARDS]
        ok = header[0] == TABLE_MAGIC and header[GEN] == gen and len(mm) == table_bytes(shards, cap)
        header.release()
        if not ok:
            return None
        self._t = t = Table.over(path, mm, gen, shards, cap)
        return t

    def _linked(self) -> bool:
        try:
            return os.fstat(self._fd).st_nlink > 0
        except OSError:  # closed meanwhile by another thread
            return False

    def answer(self, hashes: np.ndarray[Any, Any], shards: np.ndarray[Any, Any],
               tokens: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]] | None:
        """(present, vouched) per key, given its hash and its shard, and the caller's fencing token of every
        shard (uint64, 0: no holder). Vouched: the home held the key's shard under that token from before the
        probe until after it, and the probe was decided; present: vouched, stored and unexpired. None: nothing
        can be vouched for (a closed or replaced table, one rewritten during both tries, another shard count,
        clocks that do not compare)."""
        q = np.maximum(hashes, FOLD)
        for _ in range(2):
            t = self._table()
            if t is None:  # closed, or rebuilt again while being mapped: the anchor is read again
                continue
            seq = t.header[SEQ]
            if seq & 1:
                continue
            if t.tokens.size != tokens.size:  # the home numbers shards otherwise: tokens would not compare
                return None
            held = t.tokens == tokens  # per shard: fewer than the keys of a batch
            until = t.until.copy()
            # Each key's home bucket and the next, in one gather (a copy: what is decided below is what was
            # read). Undecided only when both are full without it: searched on, bucket by bucket (rare).
            rows = t.windows[(q * GOLDEN_U64) >> t.shift]
            hit = rows[:, :, 0] == q[:, None]
            full = rows[:, -1, 0] != EMPTY
            more = np.flatnonzero(full & (rows[:, BUCKET - 1, 0] != EMPTY) & ~hit.any(1)) if full.any() else ()
            found = [_search_on(t, int(q[i])) for i in more]
            if t.header[SEQ] != seq or self._anchor[1] != t.generation:
                continue
            if not self._linked():
                return None
            now = time.monotonic()
            if t.written_at[0] > now:  # the home's monotonic clock is ahead of ours: not the same clock
                return None
            present = (hit & (rows[:, :, 1].view(np.float64) > now)).any(1)
            vouched = (held & (until > now))[shards]
            for i, expiry in zip(more, found, strict=True):
                if expiry is not None and math.isnan(expiry):
                    vouched[i] = False
                else:
                    present[i] = expiry is not None and expiry > now
            return present & vouched, vouched
        return None

    def close(self) -> None:
        """Stop using the mappings (they are unmapped once no array of them is left). Idempotent."""
        self._t = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
