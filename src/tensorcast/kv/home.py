"""The shard-home role of a worker: compete for shard leases, keep the shards' pages, hand them over.

Owns: the lease loop (read the lease table and the live shard homes from the global store, release what
HRW says belongs elsewhere, renew what it holds, acquire what it should hold — a handful of global-store
requests per loop, touched per shard, never per page), what happens to pages when a lease changes
hands (``kv.custody`` decides: a shard this home stops serving keeps its pages for the next holder to
pull; a shard granted after another home held it is served once those pages arrived, ``kv.handover``),
backups (``kv.replicas``), and draining (a graceful stop hands every shard over first). Whenever its leases
change it republishes the served ones (``kv.fencing``: the fencing check every page request passes, and
their token and serve-until in the store's presence table, ``kv.presence``, beside its pages) so that
same-host callers answer lookups themselves; leases are withdrawn there before a shard stops being served.
Page TTLs count on CLOCK_MONOTONIC, like the leases. Does not own: the page requests (``kv.serving``), the
store, following the lease table and counting the live homes (``kv.census``), or the token check itself
(``kv.fencing``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

from tensorcast import clock
from tensorcast.config import KVConfig
from tensorcast.context import CallContext
from tensorcast.errors import InvalidArgument, TensorCastError
from tensorcast.kv.census import HomeCensus
from tensorcast.kv.custody import Custody, serve_at_once
from tensorcast.kv.events import PageEvents
from tensorcast.kv.fencing import ServedLeases
from tensorcast.kv.handover import Handover
from tensorcast.kv.hrw import candidates
from tensorcast.kv.leases import HomeLeases
from tensorcast.kv.pages import Page, PageStore
from tensorcast.kv.reconcile import EXPIRED, OUTRANKED, reconcile
from tensorcast.kv.serving import PageService
from tensorcast.kv_event_stream import EventPublisher, check_endpoint
from tensorcast.obs import metrics
from tensorcast.wire.caller import Caller
from tensorcast.wire.kv_messages import (
    AcquireShards,
    KVHandoff,
    KVReplicate,
    KVShardsReleased,
    ReleaseShards,
    RenewShards,
    ShardTable,
)
from tensorcast.wire.messages import Ack
from tensorcast.wire.rpc import HandlerRegistry, Request

__all__ = ["ShardHome"]

log = logging.getLogger("tensorcast.kv")


class ShardHome:
    def __init__(self, worker_id: str, config: KVConfig, gs: Caller, shm_prefix: str) -> None:
        self.worker_id = worker_id
        self.config = config
        self.gs = gs
        if not 0 <= config.lease_margin < config.lease_ttl - config.renew_interval:
            raise InvalidArgument(f"kv.lease_margin ({config.lease_margin}) must be under kv.lease_ttl - "
                                  f"kv.renew_interval ({config.lease_ttl - config.renew_interval})")
        if config.replicas < 1:
            raise InvalidArgument(f"kv.replicas must be >= 1, got {config.replicas}")
        self.leases = HomeLeases(worker_id, k=max(config.candidates, config.replicas), margin=config.lease_margin)
        self.custody = Custody(worker_id, config.handover_keep_seconds, config.replicas)
        self.store = PageStore(config.memory_capacity, f"{shm_prefix}-kv", arena_bytes=config.arena_bytes,
                               max_page_bytes=config.max_page_bytes, default_ttl=config.page_ttl, presence=True)
        self.served = ServedLeases(self.leases, self.store, lambda: self.num_shards)
        self.census = HomeCensus(worker_id, config, gs)
        self.pages = PageService(self.store, self.served.check, self._copy if config.replicas > 1 else None,
                                 max_request_bytes=config.max_request_bytes)
        self.handover = Handover(worker_id, self.store, gs, self.custody, batch_bytes=config.max_batch_bytes,
                                 owner_token=self.served.token, confirm=self._confirm, expire=self.expire,
                                 num_shards=lambda: self.num_shards, max_request_bytes=config.max_request_bytes)
        self.num_shards = 0
        self._task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # pulls and backup refills in flight
        self._wake = asyncio.Event()  # a peer released shards: run the loop now
        self._last_renewal = 0.0  # monotonic time the last renewal was sent (for the renewal-lag metric)
        self._draining = False
        self.events: EventPublisher | None = None  # KV events of this home's pages (kv.events_endpoint)
        if config.events_endpoint:
            check_endpoint(config.events_endpoint, config.events_allow_remote)
            if config.events_replay_endpoint:
                check_endpoint(config.events_replay_endpoint, config.events_allow_remote,
                               "kv.events_replay_endpoint")
            self.events = EventPublisher(config.events_endpoint, topic=config.events_topic,
                                         replay_endpoint=config.events_replay_endpoint or None,
                                         buffer_batches=config.events_buffer)

    def register(self, registry: HandlerRegistry) -> None:
        self.pages.register(registry)
        registry.register(KVHandoff, self.handover.serve)
        registry.register(KVReplicate, self.handover.copied_in, sink=self.handover.copy_sink)
        registry.register(KVShardsReleased, self.shards_released)

    async def start(self) -> None:
        if self.events is not None:
            # First AllBlocksCleared: subscribers forget what an earlier run of this home told them.
            self.store.events = PageEvents(self.events.publish, asyncio.get_running_loop().call_soon)
            self.store.events.cleared()
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        self.halt()

    def halt(self) -> None:
        """Stop at once: the lease loop and every pull or refill cancelled, the pages freed (a kill -9)."""
        for task in [self._task, *self._tasks]:
            if task is not None:
                task.cancel()
        if self.store.events is not None:
            self.store.events.cleared()
            self.store.events = None
        self.store.close()
        if self.events is not None:
            self.events.close()
            self.events = None

    # ----------------------------------------------------------------- the lease loop
    async def _loop(self) -> None:
        period = self.config.renew_interval / 2
        while True:
            try:
                await self.tick()
            except TensorCastError as exc:
                log.warning("shard lease loop: %s", exc)
            except Exception:
                log.exception("shard lease loop failed")
            self.pages.reap()
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), period)

    def _ctx(self) -> CallContext:
        return CallContext(deadline=clock.time() + max(2.0, self.config.renew_interval))

    async def _read_table(self, ctx: CallContext) -> tuple[ShardTable, list[str]]:
        """Catch up with the lease table and the live shard homes (this one included, sorted)."""
        table, homes = await self.census.read(ctx)
        self.num_shards = table.num_shards
        return table, homes

    def expire(self) -> None:
        """Step down from the shards whose lease ran out here (even while the store cannot be reached): their
        pages are then offered to whoever holds the shard next."""
        for shard in self.leases.expired(clock.monotonic()):
            self._step_down(shard, EXPIRED)

    async def tick(self) -> None:
        if self._draining:
            return
        self.expire()  # even when the store cannot be read: a lapsed lease is offered to its next holder
        # Pages past their TTL are freed here too, not only when a request touches them: their memory comes
        # back and their removal is published (kv.events) within a tick.
        with self.store.batch():
            self.store.expire(clock.monotonic())
        ctx = self._ctx()
        table, homes = await self._read_table(ctx)
        # Just after being cut off from the store, the other live homes re-acquire their own expired shards.
        plan = reconcile(self.leases, self.census.mirror.records, homes, table.num_shards, table.now,
                         clock.monotonic(), grace=self.config.renew_interval / 4, takeover=self.census.cut_off is None)
        for shard, why in plan.step_down:
            self._step_down(shard, why)
        if plan.give_back:
            await self._give_back(list(plan.give_back), homes, ctx)
        await self._renew(ctx)
        if plan.acquire:
            await self._acquire(list(plan.acquire), ctx)
        self._after_tick(homes)

    async def _give_back(self, shards: list[int], homes: list[str], ctx: CallContext, leaving: bool = False) -> None:
        """Release ``shards`` (their pages stay for the next holder to pull) and tell their next holders."""
        tokens = tuple(self.leases.held[s].token for s in shards)
        for s in shards:
            self._step_down(s, "this home is stopping" if leaving else OUTRANKED)
        await self.gs.call(ReleaseShards(worker_id=self.worker_id, shards=tuple(shards), tokens=tokens), ctx)
        others = [h for h in homes if h != self.worker_id]
        nxt: dict[str, list[int]] = {}
        for s in shards:
            ranked = candidates(s, others, 1)
            if ranked:
                nxt.setdefault(ranked[0], []).append(s)
        targets = others if leaving else list(nxt)
        await asyncio.gather(*(self._tell_released(h, tuple(nxt.get(h, ())), leaving, ctx) for h in targets))

    async def _tell_released(self, home: str, shards: tuple[int, ...], leaving: bool, ctx: CallContext) -> None:
        address = self.census.homes.get(home, "")
        if address:
            with contextlib.suppress(TensorCastError, OSError):
                await self.gs.call(KVShardsReleased(worker_id=self.worker_id, shards=shards, leaving=leaving),
                                   ctx, address=address)

    async def _renew(self, ctx: CallContext) -> None:
        mine = sorted(self.leases.held)
        if not mine:
            self._last_renewal = 0.0
            return
        ttl = self.config.lease_ttl
        sent = clock.monotonic()
        reply = await self.gs.call(RenewShards(worker_id=self.worker_id, shards=tuple(mine),
                                               tokens=tuple(self.leases.held[s].token for s in mine), ttl=ttl), ctx)
        renewed = {g.shard: g.token for g in reply.leases}
        if self._last_renewal:
            metrics.shard_renewal(sent - self._last_renewal - self.config.renew_interval / 2)
        self._last_renewal = sent
        for s in mine:
            if s in renewed and s in self.leases.held:
                self.leases.granted(s, renewed[s], sent, ttl)
            else:
                self._step_down(s, "renewal refused")
        self.served.changed()

    async def _acquire(self, shards: list[int], ctx: CallContext) -> None:
        ttl = self.config.lease_ttl
        sent = clock.monotonic()
        reply = await self.gs.call(AcquireShards(worker_id=self.worker_id, shards=tuple(shards), ttl=ttl), ctx)
        pull: dict[int, int] = {}
        own: dict[int, int] = {}  # the tenure of the pages this home kept of each shard to pull
        for g in reply.leases:
            self.leases.granted(g.shard, g.token, sent, ttl)
            kept = self.custody.granted(g.shard, g.token)
            if not serve_at_once(kept, g.token, self.worker_id):
                pull[g.shard] = g.token
                own[g.shard] = kept.token if kept is not None else 0
        self.served.receiving |= pull.keys()
        self.served.changed()
        if reply.leases:
            log.info("acquired %d shard leases (%d handed over from other homes)", len(reply.leases), len(pull))
        if pull:
            self._spawn(self._pull(pull, own))

    async def _pull(self, tokens: dict[int, int], own: dict[int, int]) -> None:
        """The newest pages other homes kept of these newly granted shards, then serve them."""
        peers = list(self.census.peers.values())
        try:
            got = await self.handover.pull(tokens, own, peers, timeout=self.config.lease_ttl)
            if got:
                log.info("received %d pages of %d shards handed over", got, len(tokens))
        finally:
            for shard in tokens.keys() & self.served.receiving:
                if shard in self.leases.held:
                    self.custody.served(shard)
            self.served.receiving -= tokens.keys()
            self.served.changed()

    def _after_tick(self, homes: list[str]) -> None:
        """Fill new backups of the shards served here, and drop the kept pages nobody needs any more."""
        now = clock.monotonic()
        if self.config.replicas > 1:
            served = [s for s in self.leases.held if s not in self.served.receiving]
            for shard, targets in self.custody.refill(served, homes).items():
                self._spawn(self._refill(shard, targets))
        for shard in self.custody.to_drop(self.store.shards(), self.leases.held, homes, now):
            n = self.store.drop_shard(shard)
            self.custody.dropped(shard)
            if n:
                log.info("dropped %d kept pages of shard %d (nobody took them over)", n, shard)

    async def _refill(self, shard: int, targets: list[str]) -> None:
        held = self.leases.held.get(shard)
        if held is None:
            return
        pages, _ = self.store.pages_of([shard], None, 1 << 62, clock.monotonic())
        addresses = [self.census.homes[t] for t in targets if self.census.homes.get(t)]
        await self.handover.copy(pages, {shard: held.token}, addresses,
                                 CallContext(deadline=clock.time() + self.config.request_timeout))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _step_down(self, shard: int, why: str) -> None:
        if shard in self.leases.held:
            self.leases.lost(shard)
            self.served.receiving.discard(shard)
            self.served.changed()  # withdrawn from the presence table before anything else happens to it
            self.custody.released(shard, clock.monotonic())
            log.info("stepped down from shard %d (%s); its %d pages are kept for its next holder", shard, why,
                     len(self.store.by_shard.get(shard, ())))

    async def shards_released(self, msg: KVShardsReleased, req: Request) -> Ack:
        """A peer released shards (it stopping: it no longer counts as a home): read the table now."""
        if msg.leaving:
            self.census.leaving(msg.worker_id)
        self._wake.set()
        return Ack()

    # ----------------------------------------------------------------- draining
    async def drain(self, timeout: float | None = None) -> int:
        """Stop competing for shards and hand every one over to its next home before this one stops: release
        them, tell the other homes, and wait (at most ``timeout``, default ``kv.handover_timeout``) until their
        pages were pulled, or their new holders' pulls have ended (a lease TTL after the grant: they took
        another home's newer tenure). Returns the pages left (0: every one was taken or superseded)."""
        if self._draining:
            return len(self.store.index)
        self._draining = True
        if self._task is not None:
            self._task.cancel()
        ctx = self._ctx()
        homes = sorted(self.census.homes)
        try:
            if any(h != self.worker_id for h in homes):
                await self._give_back(sorted(self.leases.held), homes, ctx, leaving=True)
        except TensorCastError as exc:
            log.warning("draining: releasing the shards failed: %s", exc)
        if not any(h != self.worker_id for h in homes):
            return len(self.store.index)
        deadline = clock.monotonic() + (self.config.handover_timeout if timeout is None else timeout)
        while self.store.index and clock.monotonic() < deadline and not await self._taken_over():
            await asyncio.sleep(self.config.renew_interval / 4)
            # Said again while waiting: a home that missed it would still rank this one first, and wait for it.
            others = [h for h in self.census.homes if h != self.worker_id]
            await asyncio.gather(*(self._tell_released(h, (), True, self._ctx()) for h in others))
        left = len(self.store.index)
        log.info("drained: %d pages handed over, %d left", self.handover.handed, left)
        return left

    async def _taken_over(self) -> bool:
        """Every shard with pages here was taken over: its new holder said it took what it needed (after pulling
        from here, or from a home with newer pages), or the pages are a backup's copies of a holder that still
        holds that tenure (it needs nothing from here)."""
        with contextlib.suppress(TensorCastError):
            await self._read_table(self._ctx())
        taken, tenures, recs = self.handover.taken, self.custody.tenures, self.census.mirror.records

        def done(shard: int) -> bool:
            kept = tenures.get(shard)
            token = kept.token if kept is not None else 0
            if shard in self.leases.held:
                return False
            rec = recs.get(shard)
            backup_of_live = kept is not None and rec is not None and rec.holder == kept.holder != self.worker_id \
                and rec.token == token
            return taken.get(shard, 0) > token or backup_of_live

        return all(done(s) for s in self.store.shards())

    @property
    def homes(self) -> list[str]:
        """The live shard homes as this one last counted them (itself included)."""
        return sorted(self.census.homes)

    def kept_pages(self) -> int:
        """Pages here of shards this home does not serve."""
        return sum(len(keys) for s, keys in self.store.by_shard.items() if not self.served.serves(s))

    # ----------------------------------------------------------------- hand-overs and backups
    async def _confirm(self, worker: str, tokens: dict[int, int]) -> bool:
        """Whether the lease table shows ``worker`` holding these shards under these tokens (read again from
        the global store when this home's copy does not show it yet)."""
        if self.census.shows(worker, tokens):
            return True
        with contextlib.suppress(TensorCastError):
            await self._read_table(self._ctx())
        return self.census.shows(worker, tokens)

    async def _copy(self, pages: list[tuple[str, Page]], tokens: dict[int, int]) -> None:
        """Copies of pages just stored here to their shards' backups."""
        by_target: dict[str, list[tuple[str, Page]]] = {}
        for key, page in pages:
            for target in self.custody.backups(page.shard):
                by_target.setdefault(target, []).append((key, page))
        ctx = CallContext(deadline=clock.time() + self.config.request_timeout)
        await asyncio.gather(*(self.handover.copy(group, tokens, [self.census.homes[t]], ctx)
                               for t, group in by_target.items() if self.census.homes.get(t)))
