"""The caller side of KV pages: ``client.kv.put/get/get_into/exists``, batched per shard home.

Owns: the cached shard-lease table (fetched from the global store once, refreshed only when a shard home
rejects a token or is unreachable, or a shard has no holder — O(shards) global-store requests, never per
page), grouping a batch's keys by the shard home that holds them (one round trip per home, concurrently),
the fencing tokens every request carries, bounded retries after a refresh, prefix semantics of ``exists``,
and the zero-copy ``get_into`` that receives pages straight into caller buffers. Also a benchmark-only
switch that keeps page locations in the global store instead (``locations="global-store"``), to measure
what shard homes avoid.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from tensorcast.client.locality import Locality
from tensorcast.config import KVConfig
from tensorcast.context import CallContext
from tensorcast.errors import DeadlineExceeded, InvalidArgument, StaleFencingToken, TensorCastError, Unavailable
from tensorcast.kv.blocks import BlockRegions
from tensorcast.kv.keys import KVLayout, check_keys, shard_of
from tensorcast.limits import check_ttl
from tensorcast.pool.segments import SegmentGone, map_shared
from tensorcast.records import ShardLease, SlotList
from tensorcast.wire.caller import Caller
from tensorcast.wire.kv_messages import (
    KVCommit,
    KVExists,
    KVExistsReply,
    KVGet,
    KVGetReply,
    KVPut,
    KVPutReply,
    KVRelease,
    ListShards,
    PageIndexGet,
    PageIndexPut,
    PageIndexReply,
    ShardTable,
)
from tensorcast.wire.messages import Ack

__all__ = ["AsyncKV"]

_MAX_ARENA_MAPS = 256
# Same-host pages at least this large are copied by _COPY_THREADS threads (smaller ones inline).
_PARALLEL_COPY_MIN_PAGE = 512 << 10
_COPY_THREADS = max(1, min(4, os.cpu_count() or 1))
# Read leases are handed back with the next get to the same home, or after this many seconds.
_RELEASE_DELAY = 0.05


def _page_view(page: Any) -> memoryview:
    if isinstance(page, bytes | bytearray | memoryview):
        return memoryview(page).cast("B")
    if type(page).__module__.startswith("torch"):
        page = page.detach().contiguous().reshape(-1).view(__import__("torch").uint8).numpy()
    arr = np.ascontiguousarray(page)
    return memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


_COPY_POOL: ThreadPoolExecutor | None = None


def _copy_pool() -> ThreadPoolExecutor:
    global _COPY_POOL
    if _COPY_POOL is None:
        _COPY_POOL = ThreadPoolExecutor(_COPY_THREADS, thread_name_prefix="tensorcast-kv-copy")
    return _COPY_POOL


def _copy_pages(pairs: list[tuple[memoryview, memoryview]]) -> None:
    for dst, src in pairs:
        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))


class AsyncKV:
    def __init__(self, caller: Caller, locality: Locality, config: KVConfig, *,
                 locations: str = "shard-homes") -> None:
        if locations not in ("shard-homes", "global-store"):
            raise InvalidArgument("locations must be 'shard-homes' or 'global-store'")
        self.caller = caller
        self.locality = locality
        self.config = config
        self.locations = locations
        self._table: ShardTable | None = None
        self._by_shard: dict[int, ShardLease] = {}
        self._same_host: dict[str, bool] = {}  # holder address -> pages reachable through shared memory
        self._arenas: OrderedDict[str, mmap.mmap] = OrderedDict()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._done_leases: dict[str, list[str]] = {}  # home address -> read leases to hand back
        self.table_refreshes = 0

    # ----------------------------------------------------------------- lease table
    async def refresh(self) -> ShardTable:
        """Catch up with the lease table: the changes since the last refresh (the whole table the first time,
        or when the answering global store is another one)."""
        since, epoch = (self._table.revision, self._table.epoch) if self._table is not None else (0, "")
        table = await self.caller.call(ListShards(since=since, epoch=epoch), ShardTable)
        self._table = table
        if table.full:
            self._by_shard = {}
        self._by_shard.update({lease.shard: lease for lease in table.leases})
        for lease in table.leases:
            if lease.address not in self._same_host:
                self._same_host[lease.address] = self.locality.same_host(lease.host_id)
        self.table_refreshes += 1
        return table

    async def _num_shards(self) -> int:
        if self._table is None:
            await self.refresh()
        assert self._table is not None
        return self._table.num_shards

    def _holder(self, shard: int) -> ShardLease | None:
        lease = self._by_shard.get(shard)
        return lease if lease is not None and lease.holder and lease.address else None

    async def _groups(self, keys: Sequence[str]) -> tuple[dict[str, list[int]], list[int]]:
        """Key indexes by holder address, and the indexes of keys whose shard has no holder."""
        n = await self._num_shards()
        groups: dict[str, list[int]] = {}
        orphans: list[int] = []
        for i, key in enumerate(keys):
            lease = self._holder(shard_of(key, n))
            if lease is None:
                orphans.append(i)
            else:
                groups.setdefault(lease.address, []).append(i)
        return groups, orphans

    def _tokens(self, keys: Sequence[str]) -> dict[int, int]:
        assert self._table is not None
        n = self._table.num_shards
        return {s: self._by_shard[s].token for s in {shard_of(k, n) for k in keys}}

    async def _run(self, keys: Sequence[str], op: Any, *, need_all: bool) -> None:
        """Apply ``op(address, indexes)`` to every holder's keys. A rejected token, an unreachable or slow
        home, or a shard without a home (start-up, a failover) is waited out: the lease table is read again
        and the affected keys retried, with a short backoff, for up to ``kv.handover_timeout`` seconds.
        Then writes (``need_all``) fail with ``Unavailable``; reads leave misses, never errors."""
        check_keys(keys)
        todo = list(range(len(keys)))
        give_up = time.monotonic() + self.config.handover_timeout
        attempt = 0
        while True:
            sub = [keys[i] for i in todo]
            groups, orphans = await self._groups(sub)
            results = await asyncio.gather(*(op(addr, [todo[j] for j in idx]) for addr, idx in groups.items()),
                                           return_exceptions=True)
            failed: list[int] = [todo[j] for j in orphans] if need_all else []
            for (_addr, idx), res in zip(groups.items(), results, strict=True):
                if isinstance(res, StaleFencingToken | Unavailable | DeadlineExceeded):
                    failed.extend(todo[j] for j in idx)
                elif isinstance(res, BaseException):
                    raise res
            todo = sorted(failed)
            if not todo or time.monotonic() >= give_up:
                break
            await asyncio.sleep(min(0.02 * 2**attempt, 0.25))
            attempt += 1
            with contextlib.suppress(Unavailable, DeadlineExceeded):  # the gateway itself may be failing over
                await self.refresh()
        if todo and need_all:
            raise Unavailable(f"{len(todo)} pages: no shard home has held their shards for "
                              f"{self.config.handover_timeout:g} s (kv.handover_timeout); is a worker with the "
                              "shard-home role running? Retry")
        # Reads: pages whose shard is between homes are misses, never errors.

    # ----------------------------------------------------------------- same host
    def _arena(self, path: str, address: str) -> memoryview:
        mm = self._arenas.get(path)
        if mm is None:
            try:
                mm = map_shared(path, os.stat(path).st_size)
            except (OSError, SegmentGone):
                # Same host id, yet the home's shared memory is not visible here: use the socket path.
                self._same_host[address] = False
                raise Unavailable(f"shared memory of {address} is not reachable from this process") from None
            self._arenas[path] = mm
            while len(self._arenas) > _MAX_ARENA_MAPS:
                with contextlib.suppress(BufferError):  # still being copied from: unmapped when dropped
                    self._arenas.popitem(last=False)[1].close()
        else:
            self._arenas.move_to_end(path)
        return memoryview(mm)

    def _slots(self, slots: SlotList | None, address: str) -> list[memoryview | None]:
        """The slots a same-host reply names, as views of the home's arenas (None: no slot)."""
        if slots is None:
            return []
        arenas = [self._arena(path, address) for path in slots.arenas]
        flat = array("q", slots.slots)
        return [None if flat[i] < 0 else arenas[flat[i]][flat[i + 1] : flat[i + 1] + flat[i + 2]]
                for i in range(0, len(flat), 3)]

    async def _copy(self, pairs: list[tuple[memoryview, memoryview]]) -> None:
        """dst[:] = src for each pair. Large pages: numpy copies (which release the GIL) on several threads,
        so that the copy uses the cores the home left idle; small pages: inline, since per-page hand-offs
        would cost more than the bytes (a memoryview copy holds the GIL anyway)."""
        total = sum(s.nbytes for _, s in pairs)
        if not pairs or total // len(pairs) < _PARALLEL_COPY_MIN_PAGE:
            for dst, src in pairs:
                dst[:] = src
            return
        parts = min(_COPY_THREADS, len(pairs))
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(_copy_pool(), _copy_pages, pairs[i::parts])
                               for i in range(parts)))

    def _background(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _lease_done(self, address: str, lease: str) -> None:
        """Hand a read lease back with the next get to that home, or after ``_RELEASE_DELAY`` at the latest
        (one KVRelease for all of them): a get loop then pays no extra round trip for releases."""
        pending = self._done_leases.setdefault(address, [])
        pending.append(lease)
        if len(pending) == 1:
            self._background(self._flush_leases(address))

    def _take_leases(self, address: str) -> tuple[str, ...]:
        return tuple(self._done_leases.pop(address, ()))

    async def _flush_leases(self, address: str) -> None:
        await asyncio.sleep(_RELEASE_DELAY)
        leases = self._take_leases(address)
        if leases:
            with contextlib.suppress(TensorCastError):
                await self.caller.call(KVRelease(leases=leases), Ack, address=address)

    def _ctx(self) -> CallContext:
        """One request to a shard home: a home that does not answer within ``kv.request_timeout`` (paused,
        partitioned) is treated like one that rejected the request: the table is read again."""
        return self.caller.context(self.config.request_timeout)

    def _local(self, address: str) -> bool:
        return self._same_host.get(address, False)

    async def aclose(self) -> None:
        """Hand back the read leases still held, then unmap the homes' arenas."""
        for task in list(self._tasks):
            task.cancel()
        for address in list(self._done_leases):
            leases = self._take_leases(address)
            if leases:
                with contextlib.suppress(TensorCastError, OSError):
                    await self.caller.call(KVRelease(leases=leases), Ack, address=address)
        self.close()

    def close(self) -> None:
        for mm in self._arenas.values():
            with contextlib.suppress(BufferError):
                mm.close()
        self._arenas.clear()

    # ----------------------------------------------------------------- operations
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
        views = [_page_view(p) for p in pages]
        for i, (page, view) in enumerate(zip(pages, views, strict=True)):
            if not 0 < view.nbytes <= self.config.max_page_bytes:
                raise InvalidArgument(f"page {i}: {view.nbytes} bytes; pages are 1..{self.config.max_page_bytes} "
                                      "bytes (kv.max_page_bytes)")
            if layout is not None:
                layout.check_page(view.nbytes, getattr(page, "shape", None), f"page {i}")
        stored = 0
        limit = self.config.max_batch_bytes

        async def send(address: str, idx: list[int]) -> None:
            nonlocal stored
            batch: list[int] = []
            size = 0
            local = self._local(address)
            for i in [*idx, -1]:
                if i < 0 or (batch and size + views[i].nbytes > limit and not local):
                    ks = tuple(keys[j] for j in batch)
                    msg = KVPut(keys=ks, sizes=tuple(views[j].nbytes for j in batch), tokens=self._tokens(ks),
                                ttl=ttl, same_host=local)
                    if local:  # reserve slots, copy straight into them, commit: no socket copy
                        reserved = await self.caller.call(msg, KVPutReply, self._ctx(), address=address)
                        slots = self._slots(reserved.slots, address)
                        await self._copy([(slot, views[j]) for j, slot in zip(batch, slots, strict=True)
                                          if slot is not None])
                        reply = await self.caller.call(
                            KVCommit(reservation=reserved.reservation, keys=ks, tokens=msg.tokens), KVPutReply,
                            self._ctx(), address=address)
                    else:
                        reply = await self.caller.call(msg, KVPutReply, self._ctx(), address=address,
                                                       payload=[views[j] for j in batch])
                    stored += reply.stored
                    batch, size = [], 0
                if i >= 0:
                    batch.append(i)
                    size += views[i].nbytes

        await self._run(keys, send, need_all=True)
        if self.locations == "global-store":
            await self._index_put(keys)
        return stored

    async def get(self, keys: Sequence[str]) -> list[np.ndarray[Any, Any] | None]:
        """Each page as a uint8 array, or None for a miss."""
        out: list[np.ndarray[Any, Any] | None] = [None] * len(keys)

        async def fetch(address: str, idx: list[int]) -> None:
            def sink(reply: Any) -> list[memoryview]:
                views = []
                for j, size in zip(idx, reply.sizes, strict=True):
                    if size >= 0:
                        buf = np.empty(size, np.uint8)
                        out[j] = buf
                        views.append(memoryview(buf))  # type: ignore[arg-type]
                return views

            try:
                await self._get(address, [keys[j] for j in idx], sink)
            except BaseException:
                for j in idx:  # a failed (possibly retried) request leaves no half-received page
                    out[j] = None
                raise

        if self.locations == "global-store":
            await self._index_get(keys)
        await self._run(keys, fetch, need_all=False)
        return out

    async def get_into(self, keys: Sequence[str], buffers: Sequence[Any], *,
                       layout: KVLayout | None = None) -> list[bool]:
        """Zero-copy variant: receive each hit straight into the caller's buffer (numpy array, torch CPU
        tensor or writable memoryview of at least the page size; with ``layout``, exactly one page of it).
        Returns hit flags."""
        if len(keys) != len(buffers):
            raise InvalidArgument("keys and buffers differ in length")
        targets = [_page_view(b) for b in buffers]
        if any(t.readonly for t in targets):
            raise InvalidArgument("get_into needs writable buffers")
        if layout is not None:
            for i, (buf, view) in enumerate(zip(buffers, targets, strict=True)):
                layout.check_page(view.nbytes, getattr(buf, "shape", None), f"buffer {i}")
        hits = [False] * len(keys)

        async def fetch(address: str, idx: list[int]) -> None:
            def sink(reply: Any) -> list[memoryview]:
                views = []
                for j, size in zip(idx, reply.sizes, strict=True):
                    if size >= 0:
                        if size > targets[j].nbytes:
                            raise InvalidArgument(f"page {keys[j]} has {size} bytes; its buffer holds "
                                                  f"{targets[j].nbytes}")
                        hits[j] = True
                        views.append(targets[j][:size])
                return views

            try:
                await self._get(address, [keys[j] for j in idx], sink)
            except BaseException:
                for j in idx:  # a failed (possibly retried) request is no hit, whatever landed
                    hits[j] = False
                raise

        await self._run(keys, fetch, need_all=False)
        return hits

    async def put_blocks(self, keys: Sequence[str], blocks: Any, regions: BlockRegions, *,
                         ttl: float | None = None) -> int:
        """Store block ``blocks[i]`` of a paged cache (``regions``) as page ``keys[i]``. Returns pages newly
        stored. The blocks are gathered with one vectorized copy per region, not per page."""
        ids = regions.block_ids(blocks, len(keys))
        pages = regions.gather(ids)
        return await self.put(keys, list(pages), ttl=ttl)

    async def get_blocks(self, keys: Sequence[str], blocks: Any, regions: BlockRegions) -> list[bool]:
        """Load page ``keys[i]`` into block ``blocks[i]`` of a paged cache (``regions``); hit flags. A page
        whose size is not ``regions.page_bytes`` is ``InvalidArgument``; missed blocks are left untouched."""
        ids = regions.block_ids(blocks, len(keys))
        staging = np.empty((len(keys), regions.page_bytes), np.uint8)
        hits = await self.get_into(keys, list(staging))
        hit = np.flatnonzero(hits)
        if len(hit):
            regions.scatter(ids[hit], staging[hit])
        return hits

    async def _get(self, address: str, keys: list[str], sink: Callable[[Any], list[memoryview]]) -> None:
        """One KVGet to one home; ``sink(reply)`` names the destination of each hit, in order. Same host,
        the reply names the slots and this process copies from them, then hands the read lease back."""
        ks = tuple(keys)
        if not self._local(address):
            await self.caller.call(KVGet(keys=ks, tokens=self._tokens(ks)), KVGetReply, self._ctx(), address=address,
                                   sink=sink)
            return
        msg = KVGet(keys=ks, tokens=self._tokens(ks), same_host=True, release=self._take_leases(address))
        reply = await self.caller.call(msg, KVGetReply, self._ctx(), address=address)
        try:
            dests = sink(reply)
            srcs = self._slots(reply.slots, address)
            await self._copy(list(zip(dests, srcs, strict=True)))  # type: ignore[arg-type]
        finally:
            self._lease_done(address, reply.lease)

    async def exists(self, keys: Sequence[str]) -> int:
        """How many leading keys are present (prefix semantics: stop at the first miss)."""
        present = [False] * len(keys)

        async def probe(address: str, idx: list[int]) -> None:
            ks = tuple(keys[j] for j in idx)
            reply = await self.caller.call(KVExists(keys=ks, tokens=self._tokens(ks)), KVExistsReply, self._ctx(),
                                           address=address)
            for j, flag in zip(idx, reply.present, strict=True):
                present[j] = bool(flag)

        await self._run(keys, probe, need_all=False)
        n = 0
        while n < len(keys) and present[n]:
            n += 1
        return n

    # ----------------------------------------------------------------- benchmark switch
    async def _index_put(self, keys: Sequence[str]) -> None:
        await self.caller.call(PageIndexPut(keys=tuple(keys), worker_id="kv"), Ack)

    async def _index_get(self, keys: Sequence[str]) -> None:
        await self.caller.call(PageIndexGet(keys=tuple(keys)), PageIndexReply)
