"""The shard home's side of a presence table (``kv.presence``): one writer, the home's event loop.

Owns: creating the anchor and the table segments in shared memory (space reserved up front), inserting and
removing pages (key by key, or vectorized for large batches), publishing the leases under the sequence
number, rebuilding (growth, tombstone clean-up, another shard count) and retiring segments, and closing
(generation 0 first, so that readers stop vouching at once). It keeps the layout's write order: a slot's
expiry before its hash, a slot never reused until a rebuild.
Does not own: the layout and its rules (``kv.presence``), reading (``kv.presence_reader``), or which pages
and leases there are (``kv.pages`` and ``kv.home`` tell it).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import uuid
from collections.abc import Mapping, Sequence
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
    MASK64,
    SEQ,
    SHARDS,
    TABLE_MAGIC,
    TOMBSTONE,
    Table,
    bucket_shift,
    home_buckets,
    probe,
    table_bytes,
)

__all__ = ["PresenceWriter"]

_MIN_CAPACITY = 4096
# Rebuilt when live + tombstones pass half the slots, to 8x the live pages (16 bytes a slot: 128 bytes a
# page): buckets rarely overflow, and a rebuild (~0.4 µs a live page, vectorized, on the home's event loop)
# comes after at least 3x the live pages were inserted.
_MAX_LOAD = 0.5
_SCALAR_BATCH = 32  # smaller batches are inserted and removed key by key (cheaper than numpy's set-up)


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


def _capacity_for(live: int) -> int:
    return max(_MIN_CAPACITY, 1 << (8 * live - 1).bit_length())


def _rank_in_groups(sorted_keys: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """0, 1, 2... within each run of equal values of a sorted array."""
    starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
    return np.arange(sorted_keys.size) - np.repeat(starts, np.diff(np.r_[starts, sorted_keys.size]))


def _place(t: Table, q: np.ndarray[Any, Any], e: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Insert distinct keys absent from ``t``, vectorized: each round, the keys aiming at a bucket take its next
    free slots in turn; those that do not fit try the next bucket. Expiries are stored before hashes. Returns
    the indexes of the keys that did not fit by the spill bucket (the table must grow)."""
    last = t.pairs.shape[0] - 1
    b = home_buckets(q, last).astype(np.intp)
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
        self._anchor_mm = _create(self.path, ANCHOR_BYTES)
        self._anchor = memoryview(self._anchor_mm).cast("Q")
        self._anchor[0] = ANCHOR_MAGIC
        self.live = 0  # pages in the table
        self.used = 0  # pages plus tombstones
        self.num_shards = 0
        self._t: Table | None = None
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
        b = ((h * GOLDEN) & MASK64) >> bucket_shift(last)
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
        q = np.maximum(np.array(hashes, np.uint64), FOLD)
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
        slots, _ = probe(self._t.pairs, np.unique(np.maximum(np.array(hashes, np.uint64), FOLD)))
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
        seq = t.header[SEQ]
        t.header[SEQ] = seq + 1
        t.tokens[:] = tokens
        t.until[:] = until
        t.written_at[0] = now
        t.header[SEQ] = seq + 2

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
            t = Table.over(path, _create(path, table_bytes(num_shards, cap)), gen, num_shards, cap)
            t.header[0], t.header[GEN], t.header[CAP], t.header[SHARDS] = TABLE_MAGIC, gen, cap, num_shards
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



def _retire(t: Table) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(t.path)
    for view in (t.header, t.written_at, t.words, t.floats):
        view.release()
    with contextlib.suppress(BufferError):  # numpy views still alive: unmapped when they go
        t.mm.close()
