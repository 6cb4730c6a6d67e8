"""KV pages held by a shard home: slab-arena storage, an LRU index per shard, TTLs, read leases.

Owns: storing page bytes in slots of slab arenas (shared-memory segments carved by ``pool.slab``),
the index ``key -> slot`` grouped by shard (dropping a shard when its lease is lost makes its pages
misses), LRU eviction under the capacity and TTL expiry (a miss, never wrong data), and read leases
that keep a slot from being reused while its bytes are being sent. Pages are copied out to readers,
never mapped, because slots are reused. With ``presence``, it tells a ``kv.presence`` table of every page
committed and every page freed (evicted, expired, overwritten or dropped with its shard) before its slot
can hold other bytes, or, inside ``batch`` (one synchronous handler), at its end. With ``events`` set, it
tells a ``kv.events.PageEvents`` of every page stored and every page freed other than by being stored again
(the KV events routers follow). Times (``now``,
expiries) are CLOCK_MONOTONIC seconds, the clock same-host readers of that table compare against.
Does not own: fencing (``kv.leases``) or RPC (``kv.home``).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from tensorcast.errors import InvalidArgument, ResourceExhausted
from tensorcast.kv.events import PageEvents
from tensorcast.kv.keys import key_hash
from tensorcast.kv.presence_writer import PresenceWriter
from tensorcast.pool.segments import SHM_DIR, Segment, remove_stale_segments
from tensorcast.pool.slab import SlabAllocator
from tensorcast.records import SlotList

__all__ = ["Page", "PageStore", "check_page_sizes"]


def check_page_sizes(sizes: Sequence[int], max_page_bytes: int, max_request_bytes: int) -> None:
    """Before anything is reserved or allocated for a request's pages: each is 1..``max_page_bytes``, and
    all of them at most ``max_request_bytes`` (clients split larger batches)."""
    bad = next((n for n in sizes if not 0 < n <= max_page_bytes), None)
    if bad is not None:
        raise InvalidArgument(f"page of {bad} bytes: pages must be 1..{max_page_bytes} bytes")
    total = sum(sizes)
    if total > max_request_bytes:
        raise ResourceExhausted(f"{total} bytes of pages in one request exceed kv.max_request_bytes "
                                f"({max_request_bytes}): split the batch")


@dataclass(slots=True)
class Page:
    shard: int
    arena: str
    offset: int
    nbytes: int
    slot: int
    expires: float | None
    hkey: int = 0  # the key's hash, its name in the presence table (0 without one)
    readers: int = 0  # read leases on its slot: the slot is not reused while any is held
    freed: bool = False  # evicted, overwritten or abandoned while read: the slot is freed at the last release


class PageStore:
    def __init__(self, capacity: int, prefix: str, *, arena_bytes: int = 64 << 20, max_page_bytes: int = 4 << 20,
                 default_ttl: float | None = 3600.0, presence: bool = False) -> None:
        self.capacity = capacity
        self.prefix = prefix
        self.default_ttl = default_ttl
        self.slab = SlabAllocator(arena_bytes, min_slot=4096, max_slot=max_page_bytes)
        self.max_page_bytes = max_page_bytes
        self._arenas: dict[str, Segment] = {}
        self.index: OrderedDict[str, Page] = OrderedDict()  # LRU order: oldest first
        self.by_shard: dict[int, set[str]] = {}
        self.used = 0  # slot bytes held by indexed pages and pending writes
        # Expiry times as a heap (expires, sequence, key, page); entries of pages overwritten or evicted
        # since are skipped when they come up, and the heap is rebuilt when they outnumber the live pages.
        self._expiry: list[tuple[float, int, str, Page]] = []
        self._seq = itertools.count()
        remove_stale_segments(prefix)
        # Which pages are here, for same-host readers (``kv.presence``); under this store's prefix, so that
        # whatever removes a dead home's arenas removes it too.
        self.presence = PresenceWriter(SHM_DIR, prefix) if presence else None
        self._unpublished: list[int] | None = None  # inside ``batch``: pages freed, not yet unpublished
        self.events: PageEvents | None = None  # told of every page stored and freed (``kv.events``), if set

    # ----------------------------------------------------------------- writes
    def reserve(self, shard: int, key: str, nbytes: int, now: float) -> tuple[Page, memoryview]:
        """A slot for a page about to arrive (evicting LRU pages as needed). Not visible until ``commit``."""
        if nbytes <= 0 or nbytes > self.max_page_bytes:
            raise InvalidArgument(f"page of {nbytes} bytes: pages must be 1..{self.max_page_bytes} bytes")
        slot = self.slab.slot_size(nbytes)
        assert slot is not None
        self._make_room(slot, now)
        got = self.slab.alloc(nbytes)
        if isinstance(got, int):
            arena_id = uuid.uuid4().hex[:12]
            self._arenas[arena_id] = Segment.create(SHM_DIR, f"{self.prefix}-k", self.slab.arena_bytes,
                                                    populate=True)
            self.slab.add_arena(arena_id, got)
            got = self.slab.alloc(nbytes)
            assert not isinstance(got, int)
        arena, offset = got
        self.used += slot
        page = Page(shard, arena, offset, nbytes, slot, None, key_hash(key) if self.presence is not None else 0)
        return page, self._arenas[arena].view()[offset : offset + nbytes]

    def commit(self, key: str, page: Page, ttl: float | None, now: float) -> None:
        self._index(key, page, ttl, now)
        if self.presence is not None:
            self.presence.add(page.hkey, math.inf if page.expires is None else page.expires)

    def commit_many(self, pages: Sequence[tuple[str, Page]], ttl: float | None, now: float) -> None:
        """``commit`` of every (key, page), published to the presence table in one batch."""
        for key, page in pages:
            self._index(key, page, ttl, now)
        if self.presence is not None:
            self.presence.add_many([p.hkey for _, p in pages],
                                   [math.inf if p.expires is None else p.expires for _, p in pages])

    def _index(self, key: str, page: Page, ttl: float | None, now: float) -> None:
        ttl = self.default_ttl if ttl is None else ttl
        page.expires = None if ttl is None or math.isinf(ttl) else now + ttl
        old = self.index.pop(key, None)
        if old is not None:  # the same key again: the presence entry stays (its expiry is updated)
            self._free(key, old, unpublish=False, replaced=True)
        self.index[key] = page
        if self.events is not None:
            self.events.stored(key)
        self.by_shard.setdefault(page.shard, set()).add(key)
        if page.expires is not None:
            heapq.heappush(self._expiry, (page.expires, next(self._seq), key, page))
            if len(self._expiry) > 2 * len(self.index) + 1024:
                self._expiry = [(p.expires, next(self._seq), k, p) for k, p in self.index.items()
                                if p.expires is not None]
                heapq.heapify(self._expiry)

    def abandon(self, page: Page) -> None:
        self.used -= page.slot
        self._release_slot(page)

    def _make_room(self, slot: int, now: float) -> None:
        if slot > self.capacity:
            raise ResourceExhausted(f"a {slot}-byte page exceeds the KV capacity of {self.capacity} bytes")
        self.expire(now)
        while self.used + slot > self.capacity and self.index:
            key, page = self.index.popitem(last=False)
            self._free(key, page)
        if self.used + slot > self.capacity:
            raise ResourceExhausted("KV page store full of pages being written")

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Pages freed inside leave the presence table together, at the end (one vectorized removal, not one
        per page). For one synchronous handler only: nobody can ask this home about a page in between, so
        the removal is as good as immediate, although freed slots are reused before it."""
        self._unpublished = []
        try:
            yield
        finally:
            freed, self._unpublished = self._unpublished, None
            if self.presence is not None and freed:
                self.presence.remove_many(freed)

    # ----------------------------------------------------------------- reads
    def get(self, key: str, now: float) -> Page | None:
        page = self.index.get(key)
        if page is None:
            return None
        if page.expires is not None and page.expires <= now:
            self._free(key, self.index.pop(key))
            return None
        self.index.move_to_end(key)
        return page

    def get_many(self, keys: Sequence[str], now: float) -> list[Page | None]:
        """``get`` of every key (a batch pays one method call, not one per key)."""
        index = self.index
        found = list(map(index.get, keys))
        touch = index.move_to_end
        for i, page in enumerate(found):
            if page is not None:
                if page.expires is not None and page.expires <= now:
                    found[i] = None
                    if index.get(keys[i]) is page:  # not freed already (a key asked twice)
                        self._free(keys[i], index.pop(keys[i]))
                else:
                    touch(keys[i])
        return found

    def contains(self, key: str, now: float) -> bool:
        page = self.index.get(key)
        return page is not None and (page.expires is None or page.expires > now)

    def present(self, keys: Sequence[str], now: float) -> bytes:
        """One byte per key: 1 if stored and not expired, else 0 (no LRU bump, as ``contains``)."""
        return bytes([page is not None and (page.expires is None or page.expires > now)
                      for page in map(self.index.get, keys)])

    def slot_list(self, pages: Sequence[Page | None]) -> SlotList:
        """Where these pages' slots are, for same-host callers (None: no slot)."""
        index: dict[str, int] = {}
        table = np.zeros((len(pages), 3), "<i8")  # little-endian int64 triples, whatever this host's order
        table[:, 0] = [-1 if p is None else index.setdefault(p.arena, len(index)) for p in pages]
        table[:, 1] = [0 if p is None else p.offset for p in pages]
        table[:, 2] = [0 if p is None else p.nbytes for p in pages]
        arenas = tuple(self._arenas[a].path for a in index)
        return SlotList(arenas=arenas, slots=table.tobytes())

    def hold(self, pages: Sequence[Page]) -> Callable[[], None]:
        """Read lease on many pages at once: their slots are not reused until the returned callable runs
        (counted on the pages themselves: a batch costs no allocator bookkeeping per page)."""
        for page in pages:
            page.readers += 1

        def release() -> None:
            for page in pages:
                page.readers -= 1
                if not page.readers and page.freed:
                    page.freed = False
                    self._release_slot(page)

        return release

    def view(self, page: Page) -> memoryview:
        return self._arenas[page.arena].view()[page.offset : page.offset + page.nbytes]

    def shards(self) -> list[int]:
        """The shards with pages here."""
        return [s for s, keys in self.by_shard.items() if keys]

    def pages_of(self, shards: Sequence[int], after: tuple[int, str] | None, max_bytes: int,
                 now: float) -> tuple[list[tuple[str, Page]], tuple[int, str] | None]:
        """One batch of the unexpired pages of ``shards``, in (shard, key) order after the cursor ``after``,
        at most ``max_bytes`` of them (at least one page); and the cursor of the next batch (None: done)."""
        out: list[tuple[str, Page]] = []
        total = 0
        for shard in sorted(set(shards)):
            if after is not None and shard < after[0]:
                continue
            for key in sorted(self.by_shard.get(shard, ())):
                if after is not None and (shard, key) <= after:
                    continue
                page = self.index.get(key)
                if page is None or (page.expires is not None and page.expires <= now):
                    continue
                if out and total + page.nbytes > max_bytes:
                    return out, (out[-1][1].shard, out[-1][0])
                out.append((key, page))
                total += page.nbytes
        return out, None

    @staticmethod
    def ttl_left(page: Page, now: float) -> float:
        """Seconds until ``page`` expires (inf without a TTL): what a copy elsewhere keeps."""
        return math.inf if page.expires is None else max(page.expires - now, 0.0)

    def drop_keys(self, keys: Sequence[str]) -> int:
        """Forget these pages (handed over to another home); returns how many were here."""
        n = 0
        with self.batch():
            for key in keys:
                page = self.index.pop(key, None)
                if page is not None:
                    self._free(key, page)
                    n += 1
        return n

    # ----------------------------------------------------------------- removal
    def drop_shard(self, shard: int) -> int:
        keys = self.by_shard.pop(shard, set())
        pages = [(key, page) for key in keys if (page := self.index.pop(key, None)) is not None]
        if self.presence is not None:
            self.presence.remove_many([page.hkey for _, page in pages])
        for key, page in pages:
            self._free(key, page, unindex=False, unpublish=False)
        return len(keys)

    def expire(self, now: float) -> None:
        """Free pages whose TTL has passed: O(expired pages), not O(pages)."""
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, _, key, page = heapq.heappop(heap)
            if self.index.get(key) is page:
                self._free(key, self.index.pop(key))

    def _free(self, key: str, page: Page, unindex: bool = True, unpublish: bool = True,
              replaced: bool = False) -> None:
        if self.events is not None and not replaced:
            self.events.removed(key)
        if unpublish and self.presence is not None:  # before the slot can be reused (or at the end of ``batch``)
            if self._unpublished is not None:
                self._unpublished.append(page.hkey)
            else:
                self.presence.remove(page.hkey)
        if unindex:
            keys = self.by_shard.get(page.shard)
            if keys is not None:
                keys.discard(key)
        self.used -= page.slot
        self._release_slot(page)

    def _release_slot(self, page: Page) -> None:
        if page.readers:  # being read: freed when the last read lease ends
            page.freed = True
            return
        empty = self.slab.free(page.arena, page.offset)
        if empty is not None:
            self._retire_arena(empty)

    def _retire_arena(self, arena_id: str) -> None:
        seg = self._arenas.pop(arena_id)
        seg.unlink()
        seg.try_close()

    def close(self) -> None:
        if self.presence is not None:
            self.presence.close()
            self.presence = None
        for seg in self._arenas.values():
            seg.unlink()
            seg.try_close()
        self._arenas.clear()
        self.index.clear()
        self.by_shard.clear()
        remove_stale_segments(self.prefix)

