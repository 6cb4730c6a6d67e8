"""The same-host paths of KV pages: a shard home's slab arenas and presence table mapped into this process,
the copies between its slots and the caller's memory, and lookups answered from its presence table.

Owns: mapping the arenas a reply names (kept mapped; the least recently used are unmapped past a bound),
reading a ``SlotList`` (arena, offset, size per page), and the copies: page by page between slots and
buffers (pages of 512 KiB and more on several threads, smaller ones inline), and, for pages that are
blocks of a paged cache (``BlockRegions``), one vectorized copy per arena and region straight between the
slots and the cache: no staging array, no Python loop per page. ``LocalPresence``: the presence tables
(``kv.presence``) of same-host homes, mapped once each, answering lookups for the keys they can vouch for
without a round trip, from any thread. Does not own: which slots to use, read leases or fencing
(``client.kv`` asks the shard home, which decides), or pages from another host.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from tensorcast.client.kv_route import Routes
from tensorcast.errors import InternalError, InvalidArgument, Unavailable
from tensorcast.kv.blocks import BlockRegions
from tensorcast.kv.keys import check_keys, key_hash_array
from tensorcast.kv.presence_reader import PresenceReader
from tensorcast.pool.segments import SegmentGone, map_shared
from tensorcast.records import SlotList

__all__ = ["LocalArenas", "LocalPresence"]

_MAX_ARENA_MAPS = 256
# Same-host pages at least this large are copied by _COPY_THREADS threads (smaller ones inline).
_PARALLEL_COPY_MIN_PAGE = 512 << 10
_COPY_THREADS = max(1, min(4, os.cpu_count() or 1))

_COPY_POOL: ThreadPoolExecutor | None = None


def _copy_pool() -> ThreadPoolExecutor:
    global _COPY_POOL
    if _COPY_POOL is None:
        _COPY_POOL = ThreadPoolExecutor(_COPY_THREADS, thread_name_prefix="tensorcast-kv-copy")
    return _COPY_POOL


def _copy_pages(pairs: list[tuple[memoryview, memoryview]]) -> None:
    for dst, src in pairs:
        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))


async def copy_pairs(pairs: list[tuple[memoryview, memoryview]]) -> None:
    """dst[:] = src for each pair. Large pages: numpy copies (which release the GIL) on several threads, so
    that the copy uses the cores the home left idle; small pages: inline, since per-page hand-offs would cost
    more than the bytes."""
    if not pairs:
        return
    if sum(s.nbytes for _, s in pairs) // len(pairs) < _PARALLEL_COPY_MIN_PAGE:
        for dst, src in pairs:
            dst[:] = src
        return
    parts = min(_COPY_THREADS, len(pairs))
    loop = asyncio.get_running_loop()
    await asyncio.gather(*(loop.run_in_executor(_copy_pool(), _copy_pages, pairs[i::parts]) for i in range(parts)))


def _rows(arena: mmap.mmap, width: int) -> np.ndarray[Any, Any]:
    """The arena as overlapping rows of ``width`` bytes, row ``o`` starting at byte ``o``: a slot at offset
    ``o`` is row ``o``, whatever the slot sizes (a view; the row count keeps every row inside the arena)."""
    flat = np.frombuffer(arena, np.uint8)
    if flat.size < width:
        raise InternalError(f"an arena of {flat.size} bytes cannot hold a {width}-byte page")
    return as_strided(flat, shape=(flat.size - width + 1, width), strides=(1, 1))


class LocalArenas:
    """Arenas of same-host shard homes, mapped on first use. ``unreachable(address)`` is told when a home's
    shared memory turns out not to be visible here (same host id, another container): callers then use the
    socket path for it."""

    def __init__(self, unreachable: Callable[[str], None]) -> None:
        self._maps: OrderedDict[str, mmap.mmap] = OrderedDict()
        self._unreachable = unreachable

    def _arena(self, path: str, address: str) -> mmap.mmap:
        mm = self._maps.get(path)
        if mm is not None:
            self._maps.move_to_end(path)
            return mm
        try:
            mm = map_shared(path, os.stat(path).st_size)
        except (OSError, SegmentGone):
            self._unreachable(address)
            raise Unavailable(f"shared memory of {address} is not reachable from this process") from None
        self._maps[path] = mm
        while len(self._maps) > _MAX_ARENA_MAPS:
            with contextlib.suppress(BufferError):  # still being copied from: unmapped when dropped
                self._maps.popitem(last=False)[1].close()
        return mm

    def locate(self, slots: SlotList | None, address: str) -> tuple[list[mmap.mmap], np.ndarray[Any, Any]]:
        """The arenas a reply names, mapped, and its slots as an ``[n, 3]`` array (arena index, offset, size;
        arena index -1: no slot)."""
        if slots is None:
            return [], np.empty((0, 3), np.int64)
        arenas = [self._arena(path, address) for path in slots.arenas]
        return arenas, np.frombuffer(slots.slots, "<i8").reshape(-1, 3)

    def views(self, slots: SlotList | None, address: str) -> list[memoryview | None]:
        """The slots as views of the arenas (None: no slot), for page-by-page copies."""
        arenas, table = self.locate(slots, address)
        mvs = [memoryview(a) for a in arenas]
        flat = table.ravel().tolist()
        return [None if flat[i] < 0 else mvs[flat[i]][flat[i + 1] : flat[i + 1] + flat[i + 2]]
                for i in range(0, len(flat), 3)]

    def to_blocks(self, slots: SlotList | None, address: str, regions: BlockRegions,
                  ids: np.ndarray[Any, Any]) -> None:
        """Block ``ids[i]`` := the page in slot i (every slot holds one page of ``regions.page_bytes``)."""
        arenas, table = self.locate(slots, address)
        if len(table) and (table[:, 2] != regions.page_bytes).any():
            bad = int(table[table[:, 2] != regions.page_bytes][0, 2])
            raise InvalidArgument(f"a page of {bad} bytes is not a block of these regions ({regions.page_bytes} "
                                  "bytes)")
        for a, sel in self._by_arena(table, len(ids)):
            regions.load(ids[sel], _rows(arenas[a], regions.page_bytes), table[sel, 1])

    def from_blocks(self, slots: SlotList | None, address: str, regions: BlockRegions,
                    ids: np.ndarray[Any, Any]) -> None:
        """Slot i := block ``ids[i]``, for the slots the reply names (a key already stored has none)."""
        arenas, table = self.locate(slots, address)
        for a, sel in self._by_arena(table, len(ids)):
            regions.store(ids[sel], _rows(arenas[a], regions.page_bytes), table[sel, 1])

    @staticmethod
    def _by_arena(table: np.ndarray[Any, Any], n: int) -> list[tuple[int, np.ndarray[Any, Any]]]:
        """(arena index, positions of its slots) for every arena with slots; one arena in the common case."""
        if len(table) != n:
            raise InternalError(f"the shard home named {len(table)} slots for {n} pages")
        arena = table[:, 0]
        if not len(arena):
            return []
        lo, hi = int(arena.min()), int(arena.max())
        if lo == hi:
            return [] if lo < 0 else [(lo, np.arange(n))]
        groups = [(a, np.flatnonzero(arena == a)) for a in range(max(lo, 0), hi + 1)]
        return [(a, sel) for a, sel in groups if len(sel)]

    def close(self) -> None:
        for mm in self._maps.values():
            with contextlib.suppress(BufferError):
                mm.close()
        self._maps.clear()


class LocalPresence:
    """Lookups answered from the presence tables of same-host shard homes, for the keys whose shard the
    caller's lease table (``routes()``) places on such a home and that the home's table vouches for (it holds
    the shard under the same token, now). A table is mapped once per home, when a ``KVExists`` reply names
    it (``learn``). Safe from any thread: the sync facade answers on the caller's thread while the event loop
    learns tables (state is replaced whole, never changed in place)."""

    def __init__(self, routes: Callable[[], Routes | None]) -> None:
        self._routes = routes
        self._readers: dict[str, PresenceReader] = {}  # home address -> its table
        # Per shard, the index in ``readers`` of its holder's table (-1: none), for one (routes, readers).
        self._plan: tuple[Routes, dict[str, PresenceReader], np.ndarray[Any, Any], list[PresenceReader]] | None = None

    def learn(self, address: str, path: str) -> None:
        """The home at ``address`` (same host) publishes its presence table at ``path``."""
        old = self._readers.get(address)
        if old is not None and old.path == path:
            return
        try:
            reader = PresenceReader(path)
        except (OSError, ValueError):  # not visible from here: that home keeps answering lookups itself
            return
        self._readers = {**self._readers, address: reader}
        if old is not None:
            old.close()

    def _homes(self, routes: Routes) -> tuple[np.ndarray[Any, Any], list[PresenceReader]]:
        readers = self._readers
        plan = self._plan
        if plan is not None and plan[0] is routes and plan[1] is readers:
            return plan[2], plan[3]
        holders = set(routes.addr)
        if any(a not in holders for a in readers):  # homes that hold nothing now (dead, or moved): unmapped
            gone = [r for a, r in readers.items() if a not in holders]
            readers = {a: r for a, r in readers.items() if a in holders}
            self._readers = readers  # a table learned meanwhile may be dropped: the next reply names it again
            for reader in gone:
                reader.close()
        order = {a: i for i, a in enumerate(readers)}
        home_of = np.array([order.get(a, -1) if a is not None else -1 for a in routes.addr], np.intp)
        listed = list(readers.values())
        self._plan = (routes, readers, home_of, listed)
        return home_of, listed

    def flags(self, keys: Sequence[str]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]] | None:
        """(present, vouched) per key (present implies vouched), or None when no key can be vouched for here.
        ``InvalidArgument`` for keys that are not keys, as from the round trip."""
        routes = self._routes()
        if routes is None or not routes.addr or not self._readers or not keys:
            return None
        check_keys(keys)
        q = key_hash_array(keys)
        shards = q % np.uint64(len(routes.addr))
        home_of, readers = self._homes(routes)
        homes = home_of[shards]
        if len(readers) == 1 and not homes.any():  # one same-host home holds the whole batch: no selections
            return readers[0].answer(q, shards, routes.tok)
        present = np.zeros(len(keys), bool)
        vouched = np.zeros(len(keys), bool)
        for i, reader in enumerate(readers):
            sel = homes == i
            if sel.any():
                got = reader.answer(q[sel], shards[sel], routes.tok)
                if got is not None:
                    present[sel], vouched[sel] = got
        return present, vouched

    def exists(self, keys: Sequence[str]) -> int | None:
        """How many leading keys are present, when the keys up to the first miss are all vouched for."""
        got = self.flags(keys)
        if got is None:
            return None
        present, vouched = got
        if present.all():
            return len(keys)
        n = int(present.argmin())  # the first key not present: vouched absent, or not vouched for
        return n if vouched[n] else None

    def present(self, keys: Sequence[str]) -> list[bool] | None:
        """Whether each key is present, when every key is vouched for."""
        got = self.flags(keys)
        if got is None or not got[1].all():
            return None
        return list(got[0].tolist())

    def close(self) -> None:
        readers, self._readers, self._plan = self._readers, {}, None
        for reader in readers.values():
            reader.close()
