"""The caller side of KV pages: ``client.kv.put/get/get_into/exists/present`` and the paged-cache
``put_blocks`` / ``get_blocks``, batched per shard home.

Owns: the requests of each put and get (one per shard home that holds some of a batch's keys, each carrying
the fencing tokens of the shards its keys fall in), validating pages and buffers, the zero-copy ``get_into``
that receives pages straight into caller buffers, and the one client object that composes the KV parts
(``local_presence``: the sync facade asks it on the caller's thread first). Does not own: routing, the lease
table and retries (``client.kv_route``), the same-host copies and presence tables (``client.kv_local``), the
read leases of same-host gets (``client.kv_leases``), lookups (``client.kv_lookups``). Also a
benchmark-only switch that keeps page locations in the global store instead (``locations="global-store"``),
to measure what shard homes avoid.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tensorcast.client.kv_leases import ReadLeases
from tensorcast.client.kv_local import LocalArenas, LocalPresence, copy_pairs
from tensorcast.client.kv_lookups import KVLookups
from tensorcast.client.kv_route import KVRouter, Op
from tensorcast.client.locality import Locality
from tensorcast.config import KVConfig
from tensorcast.errors import InvalidArgument, Unavailable
from tensorcast.kv.blocks import BlockRegions
from tensorcast.kv.keys import KVLayout
from tensorcast.limits import check_ttl
from tensorcast.wire.caller import Caller
from tensorcast.wire.kv_messages import KVCommit, KVGet, KVGetReply, KVPut, PageIndexGet, PageIndexPut, ShardTable

__all__ = ["AsyncKV"]


def _page_view(page: Any, i: int, max_bytes: int) -> memoryview:
    """Page ``i``'s bytes as one flat view. Refused before any copy: object arrays (their bytes are pointers
    into this process, meaningless anywhere else) and views claiming more than ``max_bytes``."""
    if isinstance(page, np.ndarray) and page.dtype.hasobject:
        raise InvalidArgument(f"page {i}: dtype {page.dtype} holds Python objects, not bytes; pages are buffers")
    if type(page) is np.ndarray and page.flags.c_contiguous and page.ndim:
        try:  # the common case, without intermediate arrays
            return memoryview(page).cast("B")  # type: ignore[arg-type]
        except (TypeError, ValueError, NotImplementedError):  # a dtype that buffers cannot cast
            pass
    if isinstance(page, bytes | bytearray | memoryview):
        return memoryview(page).cast("B")
    if type(page).__module__.startswith("torch"):
        claimed = int(page.numel()) * int(page.element_size())
    else:
        page = np.asarray(page)
        if page.dtype.hasobject:
            raise InvalidArgument(f"page {i}: {page.dtype} holds Python objects, not bytes; pages are buffers")
        claimed = int(page.size) * page.dtype.itemsize
    if claimed > max_bytes:  # a stride-0 view claiming terabytes is refused before it is copied
        raise InvalidArgument(f"page {i}: {claimed} bytes; pages are 1..{max_bytes} bytes (kv.max_page_bytes)")
    if type(page).__module__.startswith("torch"):
        page = page.detach().contiguous().reshape(-1).view(__import__("torch").uint8).numpy()
    arr = np.ascontiguousarray(page)
    return memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


class AsyncKV:
    """``client.kv``. ``local_presence`` answers lookups of same-host pages without a round trip (from any
    thread); ``exists_requests`` counts the ``KVExists`` requests sent (the lookups it could not answer)."""

    def __init__(self, caller: Caller, locality: Locality, config: KVConfig, *,
                 locations: str = "shard-homes") -> None:
        if locations not in ("shard-homes", "global-store"):
            raise InvalidArgument("locations must be 'shard-homes' or 'global-store'")
        self.caller = caller
        self.locality = locality
        self.config = config
        self.locations = locations
        self._route = KVRouter(caller, locality, config)
        self._local = self._route.local
        self._ctx = self._route.ctx
        self._arenas = LocalArenas(self._route.not_local)
        self._leases = ReadLeases(caller)
        self.local_presence = LocalPresence(lambda: self._route.routes)
        self._lookups = KVLookups(caller, config, self._route, self.local_presence)

    # ----------------------------------------------------------------- routing
    async def refresh(self) -> ShardTable:
        """Catch up with the lease table (see ``KVRouter.refresh``)."""
        return await self._route.refresh()

    @property
    def table_refreshes(self) -> int:
        return self._route.table_refreshes

    @property
    def exists_requests(self) -> int:
        return self._lookups.requests

    async def _run(self, keys: Sequence[str], op: Op, *, need_all: bool) -> None:
        """``op(address, indexes, tokens)`` for every holder's keys, retried through hand-overs (``KVRouter.run``).
        Writes (``need_all``) whose shards stayed without a home fail with ``Unavailable``; reads leave
        misses, never errors."""
        todo = await self._route.run(keys, op, need_all=need_all)
        if todo and need_all:
            raise Unavailable(f"{len(todo)} pages: no shard home has held their shards for "
                              f"{self.config.handover_timeout:g} s (kv.handover_timeout); is a worker with the "
                              "shard-home role running? Retry")

    # ----------------------------------------------------------------- plumbing
    async def aclose(self) -> None:
        """Hand back the read leases still held, then unmap the homes' arenas."""
        await self._leases.aclose()
        self.close()

    def close(self) -> None:
        self._arenas.close()
        self.local_presence.close()

    # ----------------------------------------------------------------- writes
    async def put(self, keys: Sequence[str], pages: Sequence[Any], *, ttl: float | None = None,
                  layout: KVLayout | None = None) -> int:
        """Store pages under their keys (batched, one request per shard home). Returns pages newly stored.

        A page is any contiguous buffer (numpy, torch CPU, bytes) of 1..``kv.max_page_bytes`` bytes. With
        ``layout``, each must be exactly one page of it (``layout.page_bytes``; an array of more than one
        dimension, ``layout.page_shape``), else ``InvalidArgument``. ``ttl``: seconds the pages are kept
        (default ``kv.page_ttl``)."""
        if len(keys) != len(pages):
            raise InvalidArgument("keys and pages differ in length")
        if ttl is not None:
            check_ttl(ttl)
        views = [_page_view(p, i, self.config.max_page_bytes) for i, p in enumerate(pages)]
        for i, (page, view) in enumerate(zip(pages, views, strict=True)):
            if not 0 < view.nbytes <= self.config.max_page_bytes:
                raise InvalidArgument(f"page {i}: {view.nbytes} bytes; pages are 1..{self.config.max_page_bytes} "
                                      "bytes (kv.max_page_bytes)")
            if layout is not None:
                layout.check_page(view.nbytes, getattr(page, "shape", None), f"page {i}")
        stored = 0

        async def send(address: str, idx: list[int], tokens: dict[int, int]) -> None:
            nonlocal stored
            n = await self._put_pages(address, [keys[j] for j in idx], [views[j] for j in idx], tokens, ttl)
            stored += n  # after the await: ``stored += await ...`` would read it before, losing concurrent adds

        await self._run(keys, send, need_all=True)
        if self.locations == "global-store":
            await self._index_put(keys)
        return stored

    async def _put_pages(self, address: str, keys: list[str], views: list[memoryview], tokens: dict[int, int],
                         ttl: float | None) -> int:
        """One home's pages. Same host: reserve slots, copy straight into them, commit (no socket copy).
        Otherwise in requests of at most ``kv.max_batch_bytes`` (each carrying the group's tokens)."""
        if self._local(address):
            msg = KVPut(keys=tuple(keys), sizes=tuple(v.nbytes for v in views), tokens=tokens, ttl=ttl,
                        same_host=True)
            reserved = await self.caller.call(msg, self._ctx(), address=address)
            slots = self._arenas.views(reserved.slots, address)
            await copy_pairs([(slot, v) for slot, v in zip(slots, views, strict=True) if slot is not None])
            return await self._commit(address, reserved.reservation, msg)
        stored, start, size = 0, 0, 0
        for i in range(len(keys) + 1):
            if i == len(keys) or (i > start and size + views[i].nbytes > self.config.max_batch_bytes):
                msg = KVPut(keys=tuple(keys[start:i]), sizes=tuple(v.nbytes for v in views[start:i]),
                            tokens=tokens, ttl=ttl)
                reply = await self.caller.call(msg, self._ctx(), address=address,
                                               payload=views[start:i])
                stored += reply.stored
                start, size = i, 0
            if i < len(keys):
                size += views[i].nbytes
        return stored

    async def _commit(self, address: str, reservation: str, msg: KVPut) -> int:
        reply = await self.caller.call(KVCommit(reservation=reservation, keys=msg.keys, tokens=msg.tokens),
                                       self._ctx(), address=address)
        return reply.stored

    async def put_blocks(self, keys: Sequence[str], blocks: Any, regions: BlockRegions, *,
                         ttl: float | None = None) -> int:
        """Store block ``blocks[i]`` of a paged cache (``regions``) as page ``keys[i]``. Returns pages newly
        stored. Same host, the blocks are copied straight into the reserved slots; otherwise gathered into
        one payload per home. Either way one vectorized copy per region, never a loop per page."""
        ids = regions.block_ids(blocks, len(keys))
        if ttl is not None:
            check_ttl(ttl)
        if regions.page_bytes > self.config.max_page_bytes:
            raise InvalidArgument(f"blocks of {regions.page_bytes} bytes; pages are at most "
                                  f"{self.config.max_page_bytes} bytes (kv.max_page_bytes)")
        stored = 0

        async def send(address: str, idx: list[int], tokens: dict[int, int]) -> None:
            nonlocal stored
            ks = [keys[j] for j in idx]
            if not self._local(address):
                pages = regions.gather(ids[idx])
                n = await self._put_pages(address, ks, [memoryview(p) for p in pages], tokens, ttl)
                stored += n
                return
            msg = KVPut(keys=tuple(ks), sizes=(regions.page_bytes,) * len(ks), tokens=tokens, ttl=ttl,
                        same_host=True)
            reserved = await self.caller.call(msg, self._ctx(), address=address)
            self._arenas.from_blocks(reserved.slots, address, regions, ids[idx])
            n = await self._commit(address, reserved.reservation, msg)
            stored += n

        await self._run(keys, send, need_all=True)
        return stored

    # ----------------------------------------------------------------- reads
    async def get(self, keys: Sequence[str]) -> list[np.ndarray[Any, Any] | None]:
        """Each page as a uint8 array, or None for a miss."""
        out: list[np.ndarray[Any, Any] | None] = [None] * len(keys)

        async def fetch(address: str, idx: list[int], tokens: dict[int, int]) -> None:
            def sink(reply: Any) -> list[memoryview]:
                views = []
                for j, size in zip(idx, reply.sizes, strict=True):
                    if size >= 0:
                        buf = np.empty(size, np.uint8)
                        out[j] = buf
                        views.append(memoryview(buf))  # type: ignore[arg-type]
                return views

            try:
                await self._get(address, [keys[j] for j in idx], tokens, sink)
            except BaseException:
                for j in idx:  # a failed (possibly retried) request leaves no half-received page
                    out[j] = None
                raise

        if self.locations == "global-store":
            await self._index_get(keys)
        await self._run(keys, fetch, need_all=False)
        return out

    async def get_into(self, keys: Sequence[str], buffers: Sequence[Any], *,
                       layout: KVLayout | None = None, exact: bool = False) -> list[bool]:
        """Zero-copy variant: receive each hit straight into the caller's buffer (numpy array, torch CPU
        tensor or writable memoryview of at least the page size). Returns hit flags. With ``layout``, each
        buffer must be exactly one page of it, and a stored page of another size is ``InvalidArgument``, never
        a hit; without, a page smaller than its buffer fills the buffer's first bytes (the rest is left as it
        was) and is a hit, and one larger is ``InvalidArgument``; with ``exact``, any page whose size is not its
        buffer's is ``InvalidArgument``."""
        if len(keys) != len(buffers):
            raise InvalidArgument("keys and buffers differ in length")
        targets = [_page_view(b, i, sys.maxsize) for i, b in enumerate(buffers)]
        if any(t.readonly for t in targets):
            raise InvalidArgument("get_into needs writable buffers")
        if layout is not None:
            for i, (buf, view) in enumerate(zip(buffers, targets, strict=True)):
                layout.check_page(view.nbytes, getattr(buf, "shape", None), f"buffer {i}")
        hits = [False] * len(keys)

        async def fetch(address: str, idx: list[int], tokens: dict[int, int]) -> None:
            def sink(reply: Any) -> list[memoryview]:
                views = []
                for j, size in zip(idx, reply.sizes, strict=True):
                    if size >= 0:
                        if size > targets[j].nbytes or (layout is not None and size != layout.page_bytes) \
                                or (exact and size != targets[j].nbytes):
                            raise InvalidArgument(f"page {keys[j]} has {size} bytes; its buffer holds "
                                                  f"{targets[j].nbytes}" + ("" if layout is None else
                                                  f", and a page of this layout is {layout.page_bytes}"))
                        hits[j] = True
                        views.append(targets[j] if size == targets[j].nbytes else targets[j][:size])
                return views

            try:
                await self._get(address, [keys[j] for j in idx], tokens, sink)
            except BaseException:
                for j in idx:  # a failed (possibly retried) request is no hit, whatever landed
                    hits[j] = False
                raise

        await self._run(keys, fetch, need_all=False)
        return hits

    async def get_blocks(self, keys: Sequence[str], blocks: Any, regions: BlockRegions) -> list[bool]:
        """Load page ``keys[i]`` into block ``blocks[i]`` of a paged cache (``regions``); hit flags. A page
        whose size is not ``regions.page_bytes`` is ``InvalidArgument``; missed blocks are left untouched.
        Same host, pages are copied straight from the home's slots into the blocks (one vectorized copy per
        region); otherwise received into one staging array per home, then scattered."""
        ids = regions.block_ids(blocks, len(keys))
        hits = [False] * len(keys)

        async def fetch(address: str, idx: list[int], tokens: dict[int, int]) -> None:
            ks = tuple(keys[j] for j in idx)
            if self._local(address):
                reply = await self._get_local(address, ks, tokens)
                try:
                    got = [j for j, size in zip(idx, reply.sizes, strict=True) if size >= 0]
                    self._arenas.to_blocks(reply.slots, address, regions, ids[got])
                finally:
                    self._leases.done(address, reply.lease)
            else:
                got = await self._get_staged(address, ks, tokens, regions, ids[idx])
                got = [idx[p] for p in got]
            for j in got:  # only once the whole request landed: a failed one leaves no hit
                hits[j] = True

        await self._run(keys, fetch, need_all=False)
        return hits

    async def _get_staged(self, address: str, keys: tuple[str, ...], tokens: dict[int, int], regions: BlockRegions,
                          ids: np.ndarray[Any, Any]) -> list[int]:
        """Pages from another host: received into a staging array, then scattered into blocks ``ids`` (one
        copy per region). Returns the positions (in ``keys``) of the hits."""
        staging = np.empty((len(keys), regions.page_bytes), np.uint8)
        got: list[int] = []

        def sink(reply: Any) -> list[memoryview]:
            for pos, size in enumerate(reply.sizes):
                if size >= 0:
                    if size != regions.page_bytes:
                        raise InvalidArgument(f"page {keys[pos]} has {size} bytes; a block holds "
                                              f"{regions.page_bytes}")
                    got.append(pos)
            return [memoryview(staging[pos]) for pos in got]

        await self.caller.call(KVGet(keys=keys, tokens=tokens), self._ctx(), address=address, sink=sink)
        if got:
            regions.scatter(ids[got], staging if len(got) == len(keys) else staging[got])
        return got

    async def _get_local(self, address: str, keys: tuple[str, ...], tokens: dict[int, int]) -> KVGetReply:
        """A same-host KVGet: the reply names the slots of the hits, held under a read lease that the caller
        hands back (``ReadLeases.done``) once it has copied them. Leases done with earlier go back with it."""
        msg = KVGet(keys=keys, tokens=tokens, same_host=True, release=self._leases.take(address))
        return await self.caller.call(msg, self._ctx(), address=address)

    async def _get(self, address: str, keys: list[str], tokens: dict[int, int],
                   sink: Callable[[Any], list[memoryview]]) -> None:
        """One KVGet to one home; ``sink(reply)`` names the destination of each hit, in order. Same host,
        the reply names the slots and this process copies from them, then hands the read lease back."""
        ks = tuple(keys)
        if not self._local(address):
            await self.caller.call(KVGet(keys=ks, tokens=tokens), self._ctx(), address=address,
                                   sink=sink)
            return
        reply = await self._get_local(address, ks, tokens)
        try:
            dests = sink(reply)
            srcs = self._arenas.views(reply.slots, address)
            await copy_pairs(list(zip(dests, srcs, strict=True)))  # type: ignore[arg-type]
        finally:
            self._leases.done(address, reply.lease)

    async def exists(self, keys: Sequence[str]) -> int:
        """How many leading keys are present (prefix semantics: stop at the first miss). Keys whose same-host
        home's presence table vouches for them are answered without a round trip (``kv.presence``); the
        others are asked of their homes."""
        return await self._lookups.exists(keys)

    async def present(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is present: every key answered, no prefix semantics (like ``exists`` otherwise)."""
        return await self._lookups.present(keys)

    # ----------------------------------------------------------------- benchmark switch
    async def _index_put(self, keys: Sequence[str]) -> None:
        await self.caller.call(PageIndexPut(keys=tuple(keys), worker_id="kv"))

    async def _index_get(self, keys: Sequence[str]) -> None:
        await self.caller.call(PageIndexGet(keys=tuple(keys)))
