"""Same-host presence of KV pages: which pages a shard home holds, and under which leases, published in
shared memory so that a caller on the same host answers ``exists`` without a round trip.

Owns: the layout and its rules. A **table segment** holds a header, the lease table (per shard: fencing
token and serve-until on CLOCK_MONOTONIC, one clock for every process of a Linux host) and an open-addressing
hash table of the pages: 64-bit key hashes (``kv.keys.key_hash``; 0 empty, 1 tombstone) with each page's
expiry (monotonic seconds, +inf without a TTL) beside its hash, in buckets of 8 slots. A key lives in the
first bucket from its home bucket (Fibonacci-mixed, since the keys of one shard share their low bits) that had
room; the search never wraps around: after the last bucket comes one spill bucket, and a key that does not
fit by then grows the table. So a reader reads two buckets per key in one gather, and nearly every key is
decided there. An **anchor** file, fixed for the home's life, names the current
table by its generation: a rebuild (growth, tombstone clean-up, another shard count) fills a new segment, then
bumps the generation (0: closed). ``kv.presence_writer.PresenceWriter`` is the home's side (one writer: its
event loop); ``kv.presence_reader.PresenceReader`` maps both read-only, probes a batch vectorized and says
which keys it can vouch for. Here: the constants of the layout, ``Table`` (a mapped segment's views) and the
vectorized ``probe`` both sides search with.
Does not own: which pages exist (``kv.pages`` tells the writer), which leases are held (``kv.home``), or what
a caller does with keys nobody vouched for (``client.kv`` asks their homes).

Why a reader may trust what it reads (docs/kv-pages.md): the writer stores a slot's expiry before its hash
and never reuses a slot until a rebuild (hash 0 -> h -> tombstone), so a hash and the expiry read after it
belong together; the lease table changes under a sequence number (odd while writing); a reader reads the
sequence and the anchor's generation before and after its probe and vouches only if neither moved, only for
keys whose shard the home holds under the caller's token, and only while ``now`` (read after the probe) is
before the home's serve-until — the home's own serving rule. Aligned 8-byte loads and stores are atomic, and
x86-64 keeps loads, and stores, in program order; on weaker orderings an answer may rarely be stale, which
an advisory ``exists`` tolerates (gets are fenced by the home).
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["ANCHOR_BYTES", "ANCHOR_MAGIC", "BUCKET", "CAP", "EMPTY", "FOLD", "GEN", "GOLDEN", "GOLDEN_U64",
           "HEADER", "MASK64", "SEQ", "SHARDS", "TABLE_MAGIC", "TOMBSTONE", "WRITTEN", "Table", "bucket_shift",
           "home_buckets", "probe", "table_bytes"]

EMPTY, TOMBSTONE = 0, 1
BUCKET = 8  # slots per bucket; taken slots are a prefix of their bucket (a slot is never emptied in place)
FOLD = np.uint64(2)  # key hashes 0 and 1 (the markers) are stored as 2: one more 2^-64 collision
GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: the product's top bits depend on every bit of the hash
GOLDEN_U64 = np.uint64(GOLDEN)
MASK64 = (1 << 64) - 1
ANCHOR_MAGIC = int.from_bytes(b"TCKVPA01", "little")
TABLE_MAGIC = int.from_bytes(b"TCKVPT02", "little")
ANCHOR_BYTES = 64  # magic, generation
HEADER = 8  # words: magic, seq, generation, slots (home buckets), num_shards, written_at (float64), 2 spare
SEQ, GEN, CAP, SHARDS, WRITTEN = 1, 2, 3, 4, 5


def bucket_shift(buckets: int) -> int:
    return 65 - buckets.bit_length()  # 64 - log2(buckets)


def home_buckets(q: np.ndarray[Any, Any], buckets: int) -> np.ndarray[Any, Any]:
    return (q * GOLDEN_U64) >> np.uint64(bucket_shift(buckets))


def probe(pairs: np.ndarray[Any, Any], q: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Where each table key of ``q`` is in ``pairs`` (``[buckets + 1 spill, BUCKET, 2]`` words: hash, expiry
    bits): (its slot, or -1 when absent; the expiry read with it, NaN when absent), vectorized bucket by
    bucket. A bucket with an empty slot, or the spill bucket, ends the search."""
    last = pairs.shape[0] - 1
    b = home_buckets(q, last).astype(np.intp)
    slot = np.full(q.size, -1, np.intp)
    expiry = np.full(q.size, np.nan)
    todo = np.arange(q.size)
    while todo.size:
        rows = pairs[b[todo]]
        hit = rows[:, :, 0] == q[todo, None]
        j = hit.argmax(1)
        found = hit[np.arange(todo.size), j]
        slot[todo[found]] = b[todo[found]] * BUCKET + j[found]
        expiry[todo[found]] = rows[found, j[found], 1].view(np.float64)
        todo = todo[~found & (rows[:, -1, 0] != EMPTY) & (b[todo] < last)]  # full, and a bucket follows
        b[todo] += 1
    return slot, expiry


@dataclass(frozen=True)
class Table:
    """One mapped table segment and its views (writable for the writer, read-only for readers)."""

    path: str
    mm: mmap.mmap
    generation: int
    header: memoryview  # words, cast "Q"
    written_at: memoryview[float]  # header word 5, cast "d": when the leases were last written (monotonic)
    tokens: np.ndarray[Any, Any]  # uint64 [num_shards]; 0: not held
    until: np.ndarray[Any, Any]  # float64 [num_shards]: serve-until, monotonic
    pairs: np.ndarray[Any, Any]  # uint64 [buckets + 1, BUCKET, 2]: key hash, expiry (float64 bits)
    windows: np.ndarray[Any, Any]  # [buckets, 2 * BUCKET, 2]: bucket b and the next, as one row (a view)
    words: memoryview  # ``pairs`` flat, cast "Q": one slot at a time is cheaper through it than numpy
    floats: memoryview[float]  # the same, cast "d"
    shift: np.uint64  # a key's home bucket is (key * GOLDEN mod 2^64) >> shift

    @classmethod
    def over(cls, path: str, mm: mmap.mmap, generation: int, num_shards: int, capacity: int) -> Table:
        words = np.frombuffer(mm, np.uint64)
        o, s, c = HEADER, num_shards, capacity + BUCKET
        view = memoryview(mm)
        raw = view[(o + 2 * s) * 8 : (o + 2 * s + 2 * c) * 8]
        pairs = words[o + 2 * s : o + 2 * s + 2 * c].reshape(-1, BUCKET, 2)
        windows = np.lib.stride_tricks.as_strided(pairs, (capacity // BUCKET, 2 * BUCKET, 2), pairs.strides,
                                                  writeable=False)
        return cls(path, mm, generation, view[: o * 8].cast("Q"), view[WRITTEN * 8 : WRITTEN * 8 + 8].cast("d"),
                   words[o : o + s], words[o + s : o + 2 * s].view(np.float64), pairs, windows, raw.cast("Q"),
                   raw.cast("d"), np.uint64(bucket_shift(capacity // BUCKET)))

    @property
    def expiries(self) -> np.ndarray[Any, Any]:
        return self.pairs[:, :, 1].view(np.float64)


def table_bytes(num_shards: int, capacity: int) -> int:
    return (HEADER + 2 * num_shards + 2 * (capacity + BUCKET)) * 8
