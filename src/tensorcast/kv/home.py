"""The shard-home role of a worker: compete for shard leases, keep the shards' pages, serve batched page ops.

Owns: the lease loop (read the lease table and the live shard homes from the global store, release what
HRW says belongs elsewhere, renew what it holds, acquire what it should hold — a handful of global-store
requests per loop, touched per shard, never per page), stepping down from shards it lost (their pages are
dropped: misses until republished), and the ``KVPut``/``KVGet``/``KVExists`` handlers, each checking the
fencing token of every shard it touches against a live local lease. Page bytes arrive straight into their
slab slots (scatter) and leave straight from them (gather) under read leases. It publishes its leases
(token, serve-until) and its pages to the store's presence table (``kv.presence``), whose path each
``KVExists`` reply carries, so that same-host callers answer later lookups themselves; leases are withdrawn
there before a shard's pages are dropped. Page TTLs count on CLOCK_MONOTONIC, like the leases.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tensorcast.config import KVConfig
from tensorcast.context import CallContext
from tensorcast.errors import InvalidArgument, NotFound, StaleFencingToken, TensorCastError
from tensorcast.kv.keys import MAX_KEY_BYTES, check_keys, shards_of
from tensorcast.kv.leases import HomeLeases, LeaseMirror, LeaseRecord
from tensorcast.kv.pages import Page, PageStore
from tensorcast.limits import check_ttl
from tensorcast.obs import metrics
from tensorcast.wire.caller import Caller
from tensorcast.wire.connection import Connection, Landing
from tensorcast.wire.kv_messages import (
    AcquireShards,
    KVCommit,
    KVExists,
    KVExistsReply,
    KVGet,
    KVGetReply,
    KVPut,
    KVPutReply,
    KVRelease,
    ListShards,
    ReleaseShards,
    RenewShards,
    ShardGrants,
    ShardTable,
)
from tensorcast.wire.messages import Ack, ListWorkers, WorkerList
from tensorcast.wire.rpc import HandlerRegistry, Reply, Request

__all__ = ["ShardHome"]

log = logging.getLogger("tensorcast.kv")


@dataclass
class _PendingPut:
    pages: list[tuple[str, Page] | None]  # None: the page was already stored (bytes discarded)
    started: float
    ttl: float | None = None
    done: bool = False  # committed or abandoned: its slots are no longer this put's


# Same-host reservations and read leases not committed/released within this long are reclaimed.
_SAME_HOST_TIMEOUT = 60.0


def _check_keys(keys: Sequence[str]) -> None:
    """``check_keys`` of a decoded request, whose keys are ``str`` already: the full check only when a key
    may be empty or too long."""
    if "" in keys or max(map(len, keys), default=0) > MAX_KEY_BYTES // 4:
        check_keys(keys)


class ShardHome:
    def __init__(self, worker_id: str, config: KVConfig, gs: Caller, shm_prefix: str) -> None:
        self.worker_id = worker_id
        self.config = config
        self.gs = gs
        if not 0 <= config.lease_margin < config.lease_ttl - config.renew_interval:
            raise InvalidArgument(f"kv.lease_margin ({config.lease_margin}) must be under kv.lease_ttl - "
                                  f"kv.renew_interval ({config.lease_ttl - config.renew_interval})")
        self.leases = HomeLeases(worker_id, k=config.candidates, margin=config.lease_margin)
        self.store = PageStore(config.memory_capacity, f"{shm_prefix}-kv", arena_bytes=config.arena_bytes,
                               max_page_bytes=config.max_page_bytes, default_ttl=config.page_ttl, presence=True)
        self.num_shards = 0
        self._reservations: dict[str, _PendingPut] = {}  # same-host puts awaiting KVCommit
        self._read_leases: dict[str, tuple[float, Callable[[], None]]] = {}  # same-host gets awaiting KVRelease
        self._task: asyncio.Task[None] | None = None
        self.serving = True
        self._last_renewal = 0.0  # monotonic time the last renewal was sent (for the renewal-lag metric)
        # The lease table as followed from the global store: deltas since (epoch, revision).
        self._mirror = LeaseMirror()
        # The leases as served, for checking a request's tokens in one step: shard -> token of every held
        # shard, and the earliest local expiry among them. Rebuilt whenever a lease is granted or lost.
        self._live: dict[int, int] = {}
        self._live_until = 0.0

    def register(self, registry: HandlerRegistry) -> None:
        registry.register(KVPut, self.put, sink=self.put_sink)
        registry.register(KVCommit, self.commit)
        registry.register(KVGet, self.get)
        registry.register(KVRelease, self.release)
        registry.register(KVExists, self.exists)

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.store.close()

    # ----------------------------------------------------------------- leases
    async def _loop(self) -> None:
        period = self.config.renew_interval / 2
        while True:
            try:
                await self.tick()
            except TensorCastError as exc:
                log.warning("shard lease loop: %s", exc)
            except Exception:
                log.exception("shard lease loop failed")
            self._reap_pending()
            await asyncio.sleep(period)

    async def tick(self) -> None:
        ctx = CallContext(deadline=time.time() + max(2.0, self.config.renew_interval))
        mirror = self._mirror
        table = await self.gs.call(ListShards(since=mirror.revision, epoch=mirror.epoch), ShardTable, ctx)
        workers = await self.gs.call(ListWorkers(), WorkerList, ctx)
        self.num_shards = table.num_shards
        # Deltas after the first read (the whole table again only from another global store).
        mirror.apply(table.full, (LeaseRecord(s.shard, s.holder, s.token, s.expiry, s.acquired_at)
                                  for s in table.leases), table.now, table.revision, table.epoch)
        leases = mirror.records
        # Shard homes heartbeating within a lease TTL: a dead one drops out by the time its leases expire.
        homes = [w.worker_id for w in workers.workers
                 if "shard-home" in w.roles and table.now - w.last_heartbeat < self.config.lease_ttl]
        if self.worker_id not in homes:
            homes.append(self.worker_id)
        now = time.monotonic()
        for shard in self.leases.expired(now):
            self._step_down(shard, "lease expired locally")
        for shard, held in list(self.leases.held.items()):
            rec = leases.get(shard)
            if rec is None or rec.holder != self.worker_id or rec.token != held.token:
                self._step_down(shard, "the global store shows another holder")
        acquire, give_back = self.leases.plan(leases, homes, table.num_shards, table.now,
                                              grace=self.config.renew_interval / 4)
        ttl = self.config.lease_ttl
        if give_back:
            tokens = tuple(self.leases.held[s].token for s in give_back)
            for s in give_back:
                self._step_down(s, "a better-ranked shard home is alive")
            await self.gs.call(ReleaseShards(worker_id=self.worker_id, shards=tuple(give_back), tokens=tokens),
                               ShardGrants, ctx)
        mine = sorted(self.leases.held)
        if not mine:
            self._last_renewal = 0.0
        if mine:
            sent = time.monotonic()
            reply = await self.gs.call(RenewShards(worker_id=self.worker_id, shards=tuple(mine),
                                                   tokens=tuple(self.leases.held[s].token for s in mine), ttl=ttl),
                                       ShardGrants, ctx)
            renewed = {g.shard: g.token for g in reply.leases}
            if self._last_renewal:
                metrics.shard_renewal(sent - self._last_renewal - self.config.renew_interval / 2)
            self._last_renewal = sent
            for s in mine:
                if s in renewed and s in self.leases.held:
                    self.leases.granted(s, renewed[s], sent, ttl)
                else:
                    self._step_down(s, "renewal refused")
            self._leases_changed()
        if acquire:
            sent = time.monotonic()
            reply = await self.gs.call(AcquireShards(worker_id=self.worker_id, shards=tuple(acquire), ttl=ttl),
                                       ShardGrants, ctx)
            for g in reply.leases:
                self.leases.granted(g.shard, g.token, sent, ttl)
            self._leases_changed()
            if reply.leases:
                log.info("acquired %d shard leases", len(reply.leases))

    def _step_down(self, shard: int, why: str) -> None:
        if shard in self.leases.held:
            self.leases.lost(shard)
            self._leases_changed()  # withdrawn from the presence table before its pages go
            dropped = self.store.drop_shard(shard)
            log.info("stepped down from shard %d (%s); %d pages are misses until republished", shard, why,
                     dropped)

    # ----------------------------------------------------------------- fencing
    def _leases_changed(self) -> None:
        held = self.leases.held
        self._live = {s: h.token for s, h in held.items()}
        self._live_until = min((h.local_expiry for h in held.values()), default=0.0)
        if self.store.presence is not None:  # same-host readers vouch only within the same serve-until
            self.store.presence.publish_leases({s: (h.token, h.local_expiry) for s, h in held.items()},
                                               self.num_shards, time.monotonic())

    def _check(self, keys: tuple[str, ...], tokens: dict[int, int]) -> list[int]:
        """The shard of every key, once the request's token for each of them is checked against a live
        local lease. In one step when every token the request carries is the current one of a lease held
        and no lease has expired (the common case); otherwise shard by shard, which also steps down from
        a shard a request shows a newer token for."""
        if not self.num_shards:
            raise StaleFencingToken("this shard home has no lease table yet")
        _check_keys(keys)
        shards = shards_of(keys, self.num_shards)
        now = time.monotonic()
        need = set(shards)
        if now < self._live_until and need <= tokens.keys() and tokens.items() <= self._live.items():
            return shards
        for shard in need:
            token = tokens.get(shard)
            if token is None:
                raise InvalidArgument(f"no fencing token for shard {shard}")
            held = self.leases.held.get(shard)
            if held is not None and token > held.token:
                self._step_down(shard, f"a request carries the newer token {token}")
            self.leases.check(shard, token, now)
        return shards

    # ----------------------------------------------------------------- handlers
    def _reserve(self, msg: KVPut) -> tuple[_PendingPut, list[memoryview]]:
        if len(msg.keys) != len(msg.sizes):
            raise InvalidArgument("keys and sizes differ in length")
        if msg.ttl is not None:
            check_ttl(msg.ttl)
        shards = self._check(msg.keys, msg.tokens)
        now = time.monotonic()
        pending = _PendingPut([], time.monotonic(), msg.ttl)
        views: list[memoryview] = []
        try:
            with self.store.batch():  # pages evicted to make room leave the presence table in one step
                for key, size, shard in zip(msg.keys, msg.sizes, shards, strict=True):
                    if self.store.contains(key, now):  # same key, same content: keep the stored page
                        pending.pages.append(None)
                        views.append(memoryview(bytearray(size)))  # received (and checked), then dropped
                        continue
                    page, view = self.store.reserve(shard, key, size, now)
                    pending.pages.append((key, page))
                    views.append(view)
        except BaseException:
            self._abandon(pending)
            raise
        return pending, views

    def _abandon(self, pending: _PendingPut) -> None:
        """Give back a put's reserved slots, unless it was committed (idempotent)."""
        if pending.done:
            return
        pending.done = True
        for entry in pending.pages:
            if entry is not None:
                self.store.abandon(entry[1])

    def put_sink(self, msg: KVPut, conn: Connection) -> Landing:
        """The pages' bytes land straight in their reserved slots; if the request fails before ``put``
        commits them (a checksum, a lost connection, a stale token), the slots are given back."""
        pending, views = self._reserve(msg)
        return Landing(views, pending, lambda: self._abandon(pending))

    async def put(self, msg: KVPut, req: Request) -> KVPutReply:
        if msg.same_host:
            reserved, _ = self._reserve(msg)
            rid = uuid.uuid4().hex
            self._reservations[rid] = reserved
            slots = self.store.slot_list([None if entry is None else entry[1] for entry in reserved.pages])
            return KVPutReply(stored=0, slots=slots, reservation=rid)
        pending: _PendingPut | None = req.landing
        if pending is None:
            self._check(msg.keys, msg.tokens)
            if any(msg.sizes):
                raise InvalidArgument("KVPut without its page bytes")
            return KVPutReply(stored=0)
        try:
            self._check(msg.keys, msg.tokens)  # the lease may have been lost while the bytes arrived
        except StaleFencingToken:
            self._abandon(pending)
            raise
        return KVPutReply(stored=self._commit(pending))

    def _commit(self, pending: _PendingPut) -> int:
        pending.done = True
        pages = [entry for entry in pending.pages if entry is not None]
        self.store.commit_many(pages, pending.ttl, time.monotonic())
        stored = len(pages)
        metrics.kv_pages("put", stored)
        return stored

    async def commit(self, msg: KVCommit, req: Request) -> KVPutReply:
        pending = self._reservations.pop(msg.reservation, None)
        if pending is None:
            raise NotFound(f"no KV reservation {msg.reservation} (committed, expired or lost with a lease)")
        try:
            self._check(msg.keys, msg.tokens)
        except StaleFencingToken:
            self._abandon(pending)
            raise
        return KVPutReply(stored=self._commit(pending))

    async def get(self, msg: KVGet, req: Request) -> Reply:
        self._release(msg.release)
        self._check(msg.keys, msg.tokens)
        found = self.store.get_many(msg.keys, time.monotonic())
        sizes = tuple(-1 if page is None else page.nbytes for page in found)
        hits = [page for page in found if page is not None]
        metrics.kv_pages("get", len(hits), len(found) - len(hits))
        release = self.store.hold(hits)
        if msg.same_host:  # the caller copies from the slots, then releases the read lease
            lease = uuid.uuid4().hex
            self._read_leases[lease] = (time.monotonic(), release)
            return Reply(KVGetReply(sizes=sizes, slots=self.store.slot_list(hits), lease=lease))
        views = [self.store.view(page) for page in hits]
        return Reply(KVGetReply(sizes=sizes), payload=views or None, on_sent=release)

    async def release(self, msg: KVRelease, req: Request) -> Ack:
        self._release(msg.leases)
        return Ack()

    def _release(self, leases: tuple[str, ...]) -> None:
        for lease in leases:
            held = self._read_leases.pop(lease, None)
            if held is not None:
                held[1]()

    async def exists(self, msg: KVExists, req: Request) -> KVExistsReply:
        self._check(msg.keys, msg.tokens)
        present = self.store.present(msg.keys, time.monotonic())
        hits = present.count(1)
        metrics.kv_pages("exists", hits, len(present) - hits)
        table = self.store.presence
        return KVExistsReply(present=present, presence=table.path if table is not None else "")

    def _reap_pending(self) -> None:
        """Reservations whose bytes never arrived, and same-host leases never released (the caller died)."""
        cutoff = time.monotonic() - _SAME_HOST_TIMEOUT
        for res in [r for r, p in self._reservations.items() if p.started < cutoff]:
            self._abandon(self._reservations.pop(res))
        for lease in [r for r, (t, _) in self._read_leases.items() if t < cutoff]:
            self._read_leases.pop(lease)[1]()
