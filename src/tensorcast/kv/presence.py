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
bumps the generation (0: closed). ``PresenceWriter`` is the home's side (one writer: its event loop);
``PresenceReader`` maps both read-only, probes a batch vectorized and says which keys it can vouch for.
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

import contextlib
import math
import mmap
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["BUCKET", "EMPTY", "TOMBSTONE", "PresenceReader", "PresenceWriter", "probe"]

EMPTY, TOMBSTONE = 0, 1
BUCKET = 8  # slots per bucket; taken slots are a prefix of their bucket (a slot is never emptied in place)
_FOLD = np.uint64(2)  # key hashes 0 and 1 (the markers) are stored as 2: one more 2^-64 collision
_GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: the product's top bits depend on every bit of the hash
_GOLDEN_U64 = np.uint64(_GOLDEN)
_MASK64 = (1 << 64) - 1
_ANCHOR_MAGIC = int.from_bytes(b"TCKVPA01", "little")
_TABLE_MAGIC = int.from_bytes(b"TCKVPT02", "little")
_ANCHOR_BYTES = 64  # magic, generation
_HEADER = 8  # words: magic, seq, generation, slots (home buckets), num_shards, written_at (float64), 2 spare
_SEQ, _GEN, _CAP, _SHARDS, _WRITTEN = 1, 2, 3, 4, 5
_MIN_CAPACITY = 4096
# Rebuilt when live + tombstones pass half the slots, to 8x the live pages (16 bytes a slot: 128 bytes a
# page): buckets rarely overflow, and a rebuild (~0.4 µs a live page, vectorized, on the home's event loop)
# comes after at least 3x the live pages were inserted.
_MAX_LOAD = 0.5
_READ_ROUNDS = 8  # a reader leaves a key to its home past 8 buckets (two full buckets in a row are rare)
_SCALAR_BATCH = 32  # smaller batches are inserted and removed key by key (cheaper than numpy's set-up)


def _shift(buckets: int) -> int:
    return 65 - buckets.bit_length()  # 64 - log2(buckets)


def _home_buckets(q: np.ndarray[Any, Any], buckets: int) -> np.ndarray[Any, Any]:
    return (q * _GOLDEN_U64) >> np.uint64(_shift(buckets))


def probe(pairs: np.ndarray[Any, Any], q: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Where each table key of ``q`` is in ``pairs`` (``[buckets + 1 spill, BUCKET, 2]`` words: hash, expiry
    bits): (its slot, or -1 when absent; the expiry read with it, NaN when absent), vectorized bucket by
    bucket. A bucket with an empty slot, or the spill bucket, ends the search."""
    last = pairs.shape[0] - 1
    b = _home_buckets(q, last).astype(np.intp)
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
class _Table:
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
    shift: np.uint64  # a key's home bucket is (key * _GOLDEN mod 2^64) >> shift

    @classmethod
    def over(cls, path: str, mm: mmap.mmap, generation: int, num_shards: int, capacity: int) -> _Table:
        words = np.frombuffer(mm, np.uint64)
        o, s, c = _HEADER, num_shards, capacity + BUCKET
        view = memoryview(mm)
        raw = view[(o + 2 * s) * 8 : (o + 2 * s + 2 * c) * 8]
        pairs = words[o + 2 * s : o + 2 * s + 2 * c].reshape(-1, BUCKET, 2)
        windows = np.lib.stride_tricks.as_strided(pairs, (capacity // BUCKET, 2 * BUCKET, 2), pairs.strides,
                                                  writeable=False)
        return cls(path, mm, generation, view[: o * 8].cast("Q"), view[_WRITTEN * 8 : _WRITTEN * 8 + 8].cast("d"),
                   words[o : o + s], words[o + s : o + 2 * s].view(np.float64), pairs, windows, raw.cast("Q"),
                   raw.cast("d"), np.uint64(_shift(capacity // BUCKET)))

    @property
    def expiries(self) -> np.ndarray[Any, Any]:
        return self.pairs[:, :, 1].view(np.float64)


def _table_bytes(num_shards: int, capacity: int) -> int:
    return (_HEADER + 2 * num_shards + 2 * (capacity + BUCKET)) * 8


def _create(path: str, size: int) -> mmap.mmap:
    """A new shared file of ``size`` zero bytes, its space reserved (a full /dev/shm is an error here, never a
    SIGBUS later), mapped read-write."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError:
            os.unlink(path)
            raise
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def _open(path: str) -> mmap.mmap:
    fd = os.open(path, os.O_RDONLY)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def _capacity_for(live: int) -> int:
    return max(_MIN_CAPACITY, 1 << (8 * live - 1).bit_length())


def _rank_in_groups(sorted_keys: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """0, 1, 2... within each run of equal values of a sorted array."""
    starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
    return np.arange(sorted_keys.size) - np.repeat(starts, np.diff(np.r_[starts, sorted_keys.size]))


def _place(t: _Table, q: np.ndarray[Any, Any], e: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Insert distinct keys absent from ``t``, vectorized: each round, the keys aiming at a bucket take its next
    free slots in turn; those that do not fit try the next bucket. Expiries are stored before hashes. Returns
    the indexes of the keys that did not fit by the spill bucket (the table must grow)."""
    last = t.pairs.shape[0] - 1
    b = _home_buckets(q, last).astype(np.intp)
    todo: np.ndarray[Any, Any] = np.arange(q.size)
    while todo.size:
        order = np.argsort(b[todo], kind="stable")
        who = todo[order]
        bw = b[who]
        col = (t.pairs[bw, :, 0] != EMPTY).sum(1) + _rank_in_groups(bw)
        fits = col < BUCKET
        ok, okb, okc = who[fits], bw[fits], col[fits]
        t.expiries[okb, okc] = e[ok]
        t.pairs[okb, okc, 0] = q[ok]
        todo = who[~fits]
        if todo.size and b[todo].max() == last:
            return todo
        b[todo] += 1
    return todo


class PresenceWriter:
    """A shard home's presence table: ``add``/``remove`` pages as they are committed and freed,
    ``publish_leases`` whenever its leases change, ``close`` when it stops."""

    def __init__(self, directory: str, prefix: str) -> None:
        self.path = os.path.join(directory, f"{prefix}-p-{uuid.uuid4().hex[:12]}")
        self._anchor_mm = _create(self.path, _ANCHOR_BYTES)
        self._anchor = memoryview(self._anchor_mm).cast("Q")
        self._anchor[0] = _ANCHOR_MAGIC
        self.live = 0  # pages in the table
        self.used = 0  # pages plus tombstones
        self.num_shards = 0
        self._t: _Table | None = None
        self._rebuild(0, 0)

    @property
    def capacity(self) -> int:
        """Slots in home buckets (the spill bucket aside)."""
        assert self._t is not None
        return int(self._t.windows.shape[0]) * BUCKET

    @property
    def generation(self) -> int:
        return self._t.generation if self._t is not None else 0

    # ----------------------------------------------------------------- pages
    def _probe(self, h: int) -> int:
        """The slot of ``h`` (>= 0); else -2 - the first empty slot it may take; -1: no room by the spill."""
        assert self._t is not None
        words = self._t.words
        last = self._t.pairs.shape[0] - 1
        b = ((h * _GOLDEN) & _MASK64) >> _shift(last)
        while b <= last:
            row = words[2 * BUCKET * b : 2 * BUCKET * (b + 1) : 2].tolist()  # the bucket's hashes, in one step
            if h in row:
                return BUCKET * b + row.index(h)
            if EMPTY in row:
                return -2 - (BUCKET * b + row.index(EMPTY))
            b += 1
        return -1

    def add(self, h: int, expires: float) -> None:
        """Page ``h`` (its key hash) is present until ``expires`` (monotonic; +inf: no TTL)."""
        h = h if h > 1 else 2
        i = self._probe(h)
        if i < 0 and (i == -1 or self.used + 1 > self.capacity * _MAX_LOAD):
            self._rebuild(self.live + 1, self.num_shards, grow=i == -1)
            i = self._probe(h)
        assert self._t is not None and i != -1
        slot = i if i >= 0 else -2 - i
        self._t.floats[2 * slot + 1] = expires  # before the hash: a reader that sees the hash sees its expiry
        if i < 0:
            self._t.words[2 * slot] = h
            self.live += 1
            self.used += 1

    def add_many(self, hashes: Sequence[int], expires: Sequence[float]) -> None:
        """``add`` of each (vectorized for large batches; a key given twice keeps its last expiry)."""
        if len(hashes) < _SCALAR_BATCH:
            for h, until in zip(hashes, expires, strict=True):
                self.add(h, until)
            return
        q = np.maximum(np.array(hashes, np.uint64), _FOLD)
        e = np.array(expires, np.float64)
        _, last = np.unique(q[::-1], return_index=True)
        if last.size != q.size:
            keep = q.size - 1 - last
            q, e = q[keep], e[keep]
        assert self._t is not None
        slots, _ = probe(self._t.pairs, q)
        found = slots >= 0
        self._t.pairs.reshape(-1, 2)[slots[found], 1] = e[found].view(np.uint64)
        q, e = q[~found], e[~found]
        grow = False
        while q.size:
            if grow or self.used + q.size > self.capacity * _MAX_LOAD:
                self._rebuild(self.live + q.size, self.num_shards, grow=grow)
            assert self._t is not None
            left = _place(self._t, q, e)
            self.live += q.size - left.size
            self.used += q.size - left.size
            q, e, grow = q[left], e[left], True

    def remove(self, h: int) -> None:
        i = self._probe(h if h > 1 else 2)
        if i >= 0:
            assert self._t is not None
            self._t.words[2 * i] = TOMBSTONE  # the slot stays taken until a rebuild: searches go on past it
            self.live -= 1

    def remove_many(self, hashes: Sequence[int]) -> None:
        if len(hashes) < _SCALAR_BATCH:
            for h in hashes:
                self.remove(h)
            return
        assert self._t is not None
        slots, _ = probe(self._t.pairs, np.unique(np.maximum(np.array(hashes, np.uint64), _FOLD)))
        slots = slots[slots >= 0]
        self._t.pairs.reshape(-1, 2)[slots, 0] = TOMBSTONE
        self.live -= slots.size

    # ----------------------------------------------------------------- leases
    def publish_leases(self, leases: Mapping[int, tuple[int, float]], num_shards: int, now: float) -> None:
        """The shards served now: ``{shard: (fencing token, serve-until)}`` (monotonic); every other shard is
        marked not held. Written under the sequence number, so readers never use a half-written table."""
        if num_shards != self.num_shards:
            self._rebuild(self.live, num_shards)
        t = self._t
        assert t is not None
        tokens = np.zeros(num_shards, np.uint64)
        until = np.zeros(num_shards, np.float64)
        held = [(s, tok, u) for s, (tok, u) in leases.items() if 0 <= s < num_shards]
        if held:
            shards, toks, untils = zip(*held, strict=True)
            tokens[list(shards)] = toks
            until[list(shards)] = untils
        seq = t.header[_SEQ]
        t.header[_SEQ] = seq + 1
        t.tokens[:] = tokens
        t.until[:] = until
        t.written_at[0] = now
        t.header[_SEQ] = seq + 2

    # ----------------------------------------------------------------- segments
    def _rebuild(self, live: int, num_shards: int, grow: bool = False) -> None:
        """A new table segment sized for ``live`` pages (``grow``: at least twice the current one) and
        ``num_shards`` shards, holding the current pages (and leases, for the same shard count), then announced
        through the anchor. Readers of the old one see the generation move and map the new one; the old one's
        name goes at once."""
        old = self._t
        gen = (old.generation if old is not None else 0) + 1
        cap = max(_capacity_for(live), 2 * self.capacity if grow else 0)
        while True:
            path = f"{self.path}-{gen}"
            t = _Table.over(path, _create(path, _table_bytes(num_shards, cap)), gen, num_shards, cap)
            t.header[0], t.header[_GEN], t.header[_CAP], t.header[_SHARDS] = _TABLE_MAGIC, gen, cap, num_shards
            if old is None:
                break
            flat = old.pairs.reshape(-1, 2)
            keep = flat[:, 0] > TOMBSTONE
            if not _place(t, flat[keep, 0], flat[keep, 1].view(np.float64)).size:
                break
            _retire(t)  # a run of buckets overflowed even so (improbable at a load of 1/8): larger
            cap *= 2
        self.live = self.used = int(keep.sum()) if old is not None else 0
        if old is not None and num_shards == self.num_shards:
            t.tokens[:] = old.tokens
            t.until[:] = old.until
            t.written_at[0] = old.written_at[0]
        self._t, self.num_shards = t, num_shards
        self._anchor[1] = gen
        if old is not None:
            _retire(old)

    def close(self) -> None:
        """Readers stop vouching at once (generation 0), then the files go. Idempotent."""
        if self._anchor_mm.closed:
            return
        self._anchor[1] = 0
        if self._t is not None:
            _retire(self._t)
            self._t = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._anchor.release()
        self._anchor_mm.close()


def _retire(t: _Table) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(t.path)
    for view in (t.header, t.written_at, t.words, t.floats):
        view.release()
    with contextlib.suppress(BufferError):  # numpy views still alive: unmapped when they go
        t.mm.close()


def _search_on(t: _Table, h: int) -> float | None:
    """A key whose home bucket and the next are full without it: searched on, bucket by bucket (scalar: such
    keys are few). Its expiry; None: absent; NaN: not decided within ``_READ_ROUNDS`` buckets."""
    last = t.pairs.shape[0] - 1
    home = ((h * _GOLDEN) & _MASK64) >> _shift(last)
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
            if len(anchor) * 8 < _ANCHOR_BYTES or anchor[0] != _ANCHOR_MAGIC:
                raise ValueError(f"{path} is not a presence table")
        except BaseException:
            os.close(self._fd)
            raise
        self._anchor = anchor
        self._t: _Table | None = None

    def _table(self) -> _Table | None:
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
        header = memoryview(mm)[: _HEADER * 8].cast("Q")
        cap, shards = header[_CAP], header[_SHARDS]
        ok = header[0] == _TABLE_MAGIC and header[_GEN] == gen and len(mm) == _table_bytes(shards, cap)
        header.release()
        if not ok:
            return None
        self._t = t = _Table.over(path, mm, gen, shards, cap)
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
        q = np.maximum(hashes, _FOLD)
        for _ in range(2):
            t = self._table()
            if t is None:  # closed, or rebuilt again while being mapped: the anchor is read again
                continue
            seq = t.header[_SEQ]
            if seq & 1:
                continue
            if t.tokens.size != tokens.size:  # the home numbers shards otherwise: tokens would not compare
                return None
            held = t.tokens == tokens  # per shard: fewer than the keys of a batch
            until = t.until.copy()
            # Each key's home bucket and the next, in one gather (a copy: what is decided below is what was
            # read). Undecided only when both are full without it: searched on, bucket by bucket (rare).
            rows = t.windows[(q * _GOLDEN_U64) >> t.shift]
            hit = rows[:, :, 0] == q[:, None]
            full = rows[:, -1, 0] != EMPTY
            more = np.flatnonzero(full & (rows[:, BUCKET - 1, 0] != EMPTY) & ~hit.any(1)) if full.any() else ()
            found = [_search_on(t, int(q[i])) for i in more]
            if t.header[_SEQ] != seq or self._anchor[1] != t.generation:
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
