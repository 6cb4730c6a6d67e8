"""The shard-home role of a worker: compete for shard leases, keep the shards' pages, hand them over.

Owns: the lease loop (read the lease table and the live shard homes from the global store, release what
HRW says belongs elsewhere, renew what it holds, acquire what it should hold — a handful of global-store
requests per loop, touched per shard, never per page), the fencing check every page request passes (its
token for each shard it touches against a live local lease), what happens to pages when a lease changes
hands (``kv.custody`` decides: a shard this home stops serving keeps its pages for the next holder to
pull; a shard granted after another home held it is served once those pages arrived, ``kv.handover``),
backups (``kv.replicas``), and draining (a graceful stop hands every shard over first). It publishes its
leases (token, serve-until) and its pages to the store's presence table (``kv.presence``) so that same-host
callers answer lookups themselves; leases are withdrawn there before a shard stops being served. Page TTLs
count on CLOCK_MONOTONIC, like the leases. Does not own: the page requests (``kv.serving``) or the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine, Sequence
from typing import Any

from tensorcast import clock
from tensorcast.config import KVConfig
from tensorcast.context import CallContext
from tensorcast.errors import InvalidArgument, StaleFencingToken, TensorCastError
from tensorcast.kv.custody import Custody, serve_at_once
from tensorcast.kv.handover import Handover
from tensorcast.kv.hrw import candidates
from tensorcast.kv.keys import MAX_KEY_BYTES, check_keys, shards_of
from tensorcast.kv.leases import HomeLeases, LeaseMirror, LeaseRecord, live_homes
from tensorcast.kv.pages import Page, PageStore
from tensorcast.kv.reconcile import EXPIRED, OUTRANKED, reconcile
from tensorcast.kv.serving import PageService
from tensorcast.obs import metrics
from tensorcast.wire.caller import Caller
from tensorcast.wire.kv_messages import (
    AcquireShards,
    KVHandoff,
    KVReplicate,
    KVShardsReleased,
    ListShards,
    ReleaseShards,
    RenewShards,
    ShardTable,
)
from tensorcast.wire.messages import Ack, ListWorkers
from tensorcast.wire.rpc import HandlerRegistry, Request

__all__ = ["ShardHome"]

log = logging.getLogger("tensorcast.kv")


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
        if config.replicas < 1:
            raise InvalidArgument(f"kv.replicas must be >= 1, got {config.replicas}")
        self.leases = HomeLeases(worker_id, k=max(config.candidates, config.replicas), margin=config.lease_margin)
        self.custody = Custody(worker_id, config.handover_keep_seconds, config.replicas)
        self.store = PageStore(config.memory_capacity, f"{shm_prefix}-kv", arena_bytes=config.arena_bytes,
                               max_page_bytes=config.max_page_bytes, default_ttl=config.page_ttl, presence=True)
        self.pages = PageService(self.store, self._check, self._copy if config.replicas > 1 else None,
                                 max_request_bytes=config.max_request_bytes)
        self.handover = Handover(worker_id, self.store, gs, self.custody, batch_bytes=config.max_batch_bytes,
                                 owner_token=self.serving_token, confirm=self._confirm, expire=self.expire,
                                 num_shards=lambda: self.num_shards, max_request_bytes=config.max_request_bytes)
        self.num_shards = 0
        self._task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # pulls and backup refills in flight
        self._wake = asyncio.Event()  # a peer released shards: run the loop now
        self._last_renewal = 0.0  # monotonic time the last renewal was sent (for the renewal-lag metric)
        # The lease table as followed from the global store: deltas since (epoch, revision).
        self._mirror = LeaseMirror()
        self._homes: dict[str, str] = {}  # the live shard homes (this one included) -> address
        self._peers: dict[str, str] = {}  # every shard home heard from lately: where pages may be kept
        self._last_read = 0.0  # the store's clock at the last lease-table read
        self._cut_off: tuple[float, float] | None = None  # (last read before a gap, end of its grace)
        self._leaving: dict[str, float] = {}  # homes that said they are stopping -> until when to count them out
        self._receiving: set[int] = set()  # held shards whose pages are being pulled: not served yet
        self._draining = False
        # The leases as served, for checking a request's tokens in one step: shard -> token of every held
        # shard that is served, and the earliest local expiry among them. Rebuilt whenever a lease changes.
        self._live: dict[int, int] = {}
        self._live_until = 0.0

    def register(self, registry: HandlerRegistry) -> None:
        self.pages.register(registry)
        registry.register(KVHandoff, self.handover.serve)
        registry.register(KVReplicate, self.handover.copied_in, sink=self.handover.copy_sink)
        registry.register(KVShardsReleased, self.shards_released)

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        self.halt()

    def halt(self) -> None:
        """Stop at once: the lease loop and every pull or refill cancelled, the pages freed (a kill -9)."""
        for task in [self._task, *self._tasks]:
            if task is not None:
                task.cancel()
        self.store.close()

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
        mirror = self._mirror
        table = await self.gs.call(ListShards(since=mirror.revision, epoch=mirror.epoch), ctx)
        workers = await self.gs.call(ListWorkers(), ctx)
        self.num_shards = table.num_shards
        # Deltas after the first read (the whole table again only from another global store).
        mirror.apply(table.full, (LeaseRecord(s.shard, s.holder, s.token, s.expiry, s.acquired_at)
                                  for s in table.leases), table.now, table.revision, table.epoch)
        now, ttl = clock.monotonic(), self.config.lease_ttl
        self._leaving = {w: until for w, until in self._leaving.items() if until > now}
        if self._last_read and table.now - self._last_read > self.config.renew_interval:
            self._cut_off = (self._last_read, table.now + ttl)  # cut off from the store until now
        elif self._cut_off is not None and table.now > self._cut_off[1]:
            self._cut_off = None  # every live home heartbeated since
        self._last_read = table.now
        homes = [w for w in workers.workers if "shard-home" in w.roles]
        beats = {w.worker_id: w.last_heartbeat for w in homes if w.worker_id not in self._leaving}
        live = live_homes(beats, table.now, ttl, self._cut_off[0] if self._cut_off else None)
        by_id = {w.worker_id: w.address for w in homes}
        self._homes = {w: by_id[w] for w in live}
        self._homes.setdefault(self.worker_id, "")
        # Pages may be kept by any home heard from within a few lease TTLs (a pull from a dead one fails fast).
        recent = live_homes({w.worker_id: w.last_heartbeat for w in homes}, table.now, 10 * ttl,
                            self._cut_off[0] if self._cut_off else None)
        self._peers = {w: by_id[w] for w in recent if w != self.worker_id and by_id[w]}
        return table, sorted(self._homes)

    def expire(self) -> None:
        """Step down from the shards whose lease ran out here (even while the store cannot be reached): their
        pages are then offered to whoever holds the shard next."""
        for shard in self.leases.expired(clock.monotonic()):
            self._step_down(shard, EXPIRED)

    async def tick(self) -> None:
        if self._draining:
            return
        self.expire()  # even when the store cannot be read: a lapsed lease is offered to its next holder
        ctx = self._ctx()
        table, homes = await self._read_table(ctx)
        # Just after being cut off from the store, the other live homes re-acquire their own expired shards.
        plan = reconcile(self.leases, self._mirror.records, homes, table.num_shards, table.now, clock.monotonic(),
                         grace=self.config.renew_interval / 4, takeover=self._cut_off is None)
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
        address = self._homes.get(home, "")
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
        self._leases_changed()

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
        self._receiving |= pull.keys()
        self._leases_changed()
        if reply.leases:
            log.info("acquired %d shard leases (%d handed over from other homes)", len(reply.leases), len(pull))
        if pull:
            self._spawn(self._pull(pull, own))

    async def _pull(self, tokens: dict[int, int], own: dict[int, int]) -> None:
        """The newest pages other homes kept of these newly granted shards, then serve them."""
        peers = list(self._peers.values())
        try:
            got = await self.handover.pull(tokens, own, peers, timeout=self.config.lease_ttl)
            if got:
                log.info("received %d pages of %d shards handed over", got, len(tokens))
        finally:
            for shard in tokens.keys() & self._receiving:
                if shard in self.leases.held:
                    self.custody.served(shard)
            self._receiving -= tokens.keys()
            self._leases_changed()

    def _after_tick(self, homes: list[str]) -> None:
        """Fill new backups of the shards served here, and drop the kept pages nobody needs any more."""
        now = clock.monotonic()
        if self.config.replicas > 1:
            served = [s for s in self.leases.held if s not in self._receiving]
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
        addresses = [self._homes[t] for t in targets if self._homes.get(t)]
        await self.handover.copy(pages, {shard: held.token}, addresses,
                                 CallContext(deadline=clock.time() + self.config.request_timeout))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _step_down(self, shard: int, why: str) -> None:
        if shard in self.leases.held:
            self.leases.lost(shard)
            self._receiving.discard(shard)
            self._leases_changed()  # withdrawn from the presence table before anything else happens to it
            self.custody.released(shard, clock.monotonic())
            log.info("stepped down from shard %d (%s); its %d pages are kept for its next holder", shard, why,
                     len(self.store.by_shard.get(shard, ())))

    async def shards_released(self, msg: KVShardsReleased, req: Request) -> Ack:
        """A peer released shards (it stopping: it no longer counts as a home): read the table now."""
        if msg.leaving and msg.worker_id != self.worker_id:
            self._leaving[msg.worker_id] = clock.monotonic() + self.config.handover_timeout + 2 * self.config.lease_ttl
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
        homes = sorted(self._homes)
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
            others = [h for h in self._homes if h != self.worker_id]
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
        taken, tenures, recs = self.handover.taken, self.custody.tenures, self._mirror.records

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
        return sorted(self._homes)

    def kept_pages(self) -> int:
        """Pages here of shards this home does not serve."""
        return sum(len(keys) for s, keys in self.store.by_shard.items() if s not in self._live)

    # ----------------------------------------------------------------- fencing
    def serving_token(self, shard: int) -> int:
        """The token ``shard`` is served under here (0: not served here)."""
        held = self.leases.held.get(shard)
        if held is None or shard in self._receiving or clock.monotonic() >= held.local_expiry:
            return 0
        return held.token

    async def _confirm(self, worker: str, tokens: dict[int, int]) -> bool:
        """Whether the lease table shows ``worker`` holding these shards under these tokens (read again from
        the global store when this home's copy does not show it yet)."""
        def shown() -> bool:
            recs = self._mirror.records
            return all((r := recs.get(s)) is not None and r.holder == worker and r.token == t
                       for s, t in tokens.items())

        if shown():
            return True
        with contextlib.suppress(TensorCastError):
            await self._read_table(self._ctx())
        return shown()

    async def _copy(self, pages: list[tuple[str, Page]], tokens: dict[int, int]) -> None:
        """Copies of pages just stored here to their shards' backups."""
        by_target: dict[str, list[tuple[str, Page]]] = {}
        for key, page in pages:
            for target in self.custody.backups(page.shard):
                by_target.setdefault(target, []).append((key, page))
        ctx = CallContext(deadline=clock.time() + self.config.request_timeout)
        await asyncio.gather(*(self.handover.copy(group, tokens, [self._homes[t]], ctx)
                               for t, group in by_target.items() if self._homes.get(t)))

    def _leases_changed(self) -> None:
        held = self.leases.held
        served = {s: h for s, h in held.items() if s not in self._receiving}
        self._live = {s: h.token for s, h in served.items()}
        self._live_until = min((h.local_expiry for h in served.values()), default=0.0)
        if self.store.presence is not None:  # same-host readers vouch only within the same serve-until
            self.store.presence.publish_leases({s: (h.token, h.local_expiry) for s, h in served.items()},
                                               self.num_shards, clock.monotonic())

    def _check(self, keys: tuple[str, ...], tokens: dict[int, int]) -> list[int]:
        """The shard of every key, once the request's token for each of them is checked against a live
        local lease. In one step when every token the request carries is the current one of a lease held
        and no lease has expired (the common case); otherwise shard by shard, which also steps down from
        a shard a request shows a newer token for."""
        if not self.num_shards:
            raise StaleFencingToken("this shard home has no lease table yet")
        _check_keys(keys)
        shards = shards_of(keys, self.num_shards)
        now = clock.monotonic()
        need = set(shards)
        if now < self._live_until and need <= tokens.keys() and tokens.items() <= self._live.items():
            return shards
        for shard in need:
            token = tokens.get(shard)
            if token is None:
                raise InvalidArgument(f"no fencing token for shard {shard}")
            self.leases.check(shard, token, now)
            if shard in self._receiving:
                raise StaleFencingToken(f"shard {shard} is being handed over to this home: retry")
        return shards

