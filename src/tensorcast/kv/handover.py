"""Moving KV pages between shard homes: hand-overs to a shard's new holder, and copies to its backups.

Owns the requests homes send each other (``kv.custody`` decides when): a home granted a shard that another
home held last pulls that home's kept pages (``KVHandoff``, in batches; the cursor of each request
acknowledges the batches before it, and the asked home drops what was acknowledged once its view of the
lease table confirms the grant), and with ``kv.replicas`` > 1 the holder copies every page it stores to the
shard's backups (``KVReplicate``), and fills a new backup with the shard's pages. Received pages land
straight in their slab slots; a page already stored is kept as it is. Does not own: leases and fencing
(``kv.home``), which pages to keep (``kv.custody``) or the page store (``kv.pages``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from tensorcast import clock
from tensorcast.context import CallContext
from tensorcast.errors import DeadlineExceeded, InvalidArgument, StaleFencingToken, TensorCastError
from tensorcast.kv.custody import Copies, Custody, choose_sources
from tensorcast.kv.keys import check_keys, shard_of
from tensorcast.kv.pages import Page, PageStore, check_page_sizes
from tensorcast.wire.caller import Caller
from tensorcast.wire.connection import Connection, Landing, NotSent
from tensorcast.wire.kv_messages import KVHandoff, KVPages, KVPutReply, KVReplicate
from tensorcast.wire.rpc import Reply, Request

__all__ = ["Handover", "Received"]

log = logging.getLogger("tensorcast.kv")


@dataclass
class Received:
    """Pages arriving from another home: reserved slots (None: the page was here already) until committed."""

    pages: list[tuple[str, Page] | None]
    ttls: Sequence[float]
    done: bool = False
    scratch: list[Callable[[], None]] = field(default_factory=list)  # receive budget held for dropped bytes

    def release_scratch(self) -> None:
        for release in self.scratch:
            release()
        self.scratch.clear()


class Handover:
    """``custody``: the tenure of each shard's pages here; ``owner_token(shard)``: the token this home serves
    ``shard`` under (0: not served here); ``confirm(worker, tokens)``: whether the lease table shows ``worker``
    holding those shards under those tokens (read again from the global store when it does not yet)."""

    def __init__(self, worker_id: str, store: PageStore, caller: Caller, custody: Custody, *, batch_bytes: int,
                 owner_token: Callable[[int], int], confirm: Callable[[str, dict[int, int]], Awaitable[bool]],
                 num_shards: Callable[[], int], expire: Callable[[], None] = lambda: None,
                 max_request_bytes: int = 64 << 20) -> None:
        self._expire = expire
        self.max_request_bytes = max_request_bytes
        self.worker_id = worker_id
        self.store = store
        self.caller = caller
        self.custody = custody
        self.batch_bytes = batch_bytes
        self._owner_token = owner_token
        self._confirm = confirm
        self._num_shards = num_shards
        self.pulled = 0  # pages received in hand-overs
        self.handed = 0  # pages handed over (and dropped here)
        self.copied = 0  # pages copied to backups
        self.copy_failures = 0
        self.last_asked = 0.0  # monotonic time another home last asked for pages
        # Shards another home took over and said so (KVHandoff done) -> its token: what is kept here of them may go.
        self.taken: dict[int, int] = {}

    # ----------------------------------------------------------------- receiving pages (pull replies, copies)
    def reserve(self, keys: Sequence[str], sizes: Sequence[int], ttls: Sequence[float],
                conn: Connection | None = None) -> tuple[Received, list[memoryview]]:
        """Slots for pages arriving from another home; a page already stored is received into scratch
        (charged to the receive budget with ``conn``) and dropped. Sizes are checked first."""
        if not len(keys) == len(sizes) == len(ttls):
            raise InvalidArgument("keys, sizes and ttls differ in length")
        check_keys(keys)
        check_page_sizes(sizes, self.store.max_page_bytes, self.max_request_bytes)
        n, now = self._num_shards(), clock.monotonic()
        if not n:
            raise StaleFencingToken("this shard home has no lease table yet")
        got = Received([], ttls)
        views: list[memoryview] = []
        try:
            with self.store.batch():
                for key, size in zip(keys, sizes, strict=True):
                    if self.store.contains(key, now):
                        got.pages.append(None)
                        view, release = conn.scratch(size) if conn is not None else \
                            (memoryview(bytearray(size)), lambda: None)
                        got.scratch.append(release)
                        views.append(view)
                        continue
                    page, view = self.store.reserve(shard_of(key, n), key, size, now)
                    got.pages.append((key, page))
                    views.append(view)
        except BaseException:
            self.abandon(got)
            raise
        return got, views

    def abandon(self, got: Received) -> None:
        got.release_scratch()
        if not got.done:
            got.done = True
            for entry in got.pages:
                if entry is not None:
                    self.store.abandon(entry[1])

    def commit(self, got: Received) -> int:
        got.done = True
        got.release_scratch()
        now = clock.monotonic()
        for entry, ttl in zip(got.pages, got.ttls, strict=True):
            if entry is not None:
                self.store.commit(entry[0], entry[1], ttl if ttl > 0 else 1e-9, now)
        return sum(entry is not None for entry in got.pages)

    # ----------------------------------------------------------------- serving a hand-over
    async def serve(self, msg: KVHandoff, req: Request) -> Reply:
        """A probe (which tenure of each shard is kept here), or one batch of the pages kept here of the asked
        tenures, after the cursor; the pages up to the cursor were received and are dropped here, if the lease
        table confirms the asker's grant."""
        self.last_asked = clock.monotonic()
        self._expire()  # a lease that ran out here: its pages are on offer now, not at the next loop
        for shard, token in msg.tokens.items():
            mine = self._owner_token(shard)
            if mine and mine >= token:
                raise StaleFencingToken(f"shard {shard} is served here under token {mine}, not {token}")
        if msg.done:
            if await self._confirm(msg.worker_id, msg.tokens):
                self.taken.update(msg.tokens)
            return Reply(KVPages(keys=(), sizes=(), ttls=()))
        if not msg.tenures:
            return Reply(KVPages(keys=(), sizes=(), ttls=(),
                                 tenures={s: self.custody.offered(s, t) for s, t in msg.tokens.items()}))
        shards = [s for s, t in msg.tenures.items()
                  if s in msg.tokens and self.custody.hands_over(s, msg.tokens[s], t)]
        after = (msg.after_shard, msg.after_key) if msg.after_shard >= 0 else None
        if after is not None and shards and await self._confirm(msg.worker_id, msg.tokens):
            self.handed += self._drop_up_to(shards, after)
        limit = min(msg.max_bytes or self.batch_bytes, self.batch_bytes)
        now = clock.monotonic()
        pages, _ = self.store.pages_of(shards, after, limit, now)
        release = self.store.hold([p for _, p in pages])
        reply = KVPages(keys=tuple(k for k, _ in pages), sizes=tuple(p.nbytes for _, p in pages),
                        ttls=tuple(self.store.ttl_left(p, now) for _, p in pages))
        return Reply(reply, payload=[self.store.view(p) for _, p in pages] or None, on_sent=release)

    def _drop_up_to(self, shards: list[int], cursor: tuple[int, str]) -> int:
        keys: list[str] = []
        for shard in shards:
            if shard <= cursor[0]:
                keys.extend(k for k in self.store.by_shard.get(shard, ()) if (shard, k) <= cursor)
        return self.store.drop_keys(keys)

    # ----------------------------------------------------------------- pulling (the new holder)
    async def pull(self, tokens: dict[int, int], own: dict[int, int], peers: Sequence[str], timeout: float) -> int:
        """Bring in the newest pages of ``tokens``' newly granted shards: ask every peer which tenure it keeps,
        then take the newest one on offer (``kv.custody.choose_sources``) — this home's own (``own``: shard ->
        tenure kept here, 0: none) or the peers' — dropping this home's older pages first. Returns how many
        pages arrived. A peer that fails or is too slow is given up on (its pages become misses)."""
        if not tokens:
            return 0
        deadline = clock.time() + timeout
        # A peer that does not answer its probe within a third of the time is left out: the rest is the pull's.
        probes = await asyncio.gather(*(self._probe(a, tokens, clock.time() + timeout / 3) for a in peers))
        log.debug("hand-over of %s: own %s, offers %s", tokens, own, dict(zip(peers, probes, strict=True)))
        sources: dict[str, dict[int, int]] = {}
        for shard, token in tokens.items():
            offers = {a: p.get(shard, 0) for a, p in zip(peers, probes, strict=True) if p is not None}
            best, chosen = choose_sources(own.get(shard, 0), offers, token)
            if own.get(shard, 0) != best:
                self.store.drop_shard(shard)  # older than what a peer keeps: a page put again may have other bytes
            self.custody.pulling(shard, best)
            for a in chosen:
                sources.setdefault(a, {})[shard] = best
        addresses = list(sources)
        counts = await asyncio.gather(*(self._pull_from(a, tokens, sources[a], deadline) for a in addresses),
                                      return_exceptions=True)
        got = 0
        for address, n in zip(addresses, counts, strict=True):
            if isinstance(n, BaseException):
                log.info("hand-over from %s incomplete: %s", address, n)
            else:
                got += n
        self.pulled += got
        answered = [a for a, p in zip(peers, probes, strict=True) if p is not None]
        await asyncio.gather(*(self._done(a, tokens, deadline) for a in answered))
        return got

    async def _done(self, address: str, tokens: dict[int, int], deadline: float) -> None:
        """Tell a probed home that this one has taken what it needed of ``tokens``' shards."""
        ctx = CallContext(deadline=max(deadline, clock.time() + 0.5))
        with contextlib.suppress(TensorCastError):
            await self.caller.call(KVHandoff(worker_id=self.worker_id, tokens=tokens, done=True), ctx,
                                   address=address)

    async def _probe(self, address: str, tokens: dict[int, int], deadline: float) -> dict[int, int] | None:
        """Which tenure of each shard ``address`` keeps (None: it did not answer in time, or refused)."""
        attempt = 0
        while clock.time() < deadline:
            now = clock.time()
            ctx = CallContext(deadline=min(deadline, now + max(0.25, (deadline - now) / 3)))
            try:
                reply = await self.caller.call(KVHandoff(worker_id=self.worker_id, tokens=tokens), ctx,
                                               address=address)
                return reply.tenures
            except (NotSent, StaleFencingToken):
                return None
            except TensorCastError:
                attempt += 1
                await asyncio.sleep(min(0.02 * 2**attempt, 0.5))
        return None

    async def _pull_from(self, address: str, tokens: dict[int, int], tenures: dict[int, int], deadline: float) -> int:
        """Every batch from one peer. A request that fails for a reason a retry can outlast (a lost message, a
        slow peer, a reset connection) is asked again from the same cursor until ``deadline``; a peer that
        refuses the connection is dead, and one that serves a shard under a newer token is not asked again."""
        after_shard, after_key, got = -1, "", 0
        n = self._num_shards()
        attempt = 0
        while True:
            now = clock.time()
            if now >= deadline:
                raise DeadlineExceeded(f"hand-over from {address}: deadline passed")
            # Each request gets a share of the time left, so that a lost one leaves time to ask again.
            ctx = CallContext(deadline=min(deadline, now + max(0.25, (deadline - now) / 3)))
            msg = KVHandoff(worker_id=self.worker_id, tokens=tokens, tenures=tenures, after_shard=after_shard,
                            after_key=after_key, max_bytes=self.batch_bytes)
            landing: list[Received] = []
            try:
                reply = await self.caller.call(msg, ctx, address=address, sink=self._sink(landing))
            except (NotSent, StaleFencingToken):
                for received in landing:
                    self.abandon(received)
                raise
            except TensorCastError:
                for received in landing:
                    self.abandon(received)
                attempt += 1
                await asyncio.sleep(min(0.02 * 2**attempt, 0.5))
                continue
            except BaseException:
                for received in landing:
                    self.abandon(received)
                raise
            attempt = 0
            if not reply.keys:
                return got  # this empty batch acknowledged the last one
            got += self.commit(landing[0]) if landing else 0
            after_shard, after_key = shard_of(reply.keys[-1], n), reply.keys[-1]

    def _sink(self, landing: list[Received]) -> Callable[[KVPages], list[memoryview]]:
        """Where a hand-over batch's bytes land: slots reserved when its reply arrives."""
        def sink(reply: KVPages) -> list[memoryview]:
            received, views = self.reserve(reply.keys, reply.sizes, reply.ttls)
            landing.append(received)
            return views

        return sink

    # ----------------------------------------------------------------- copies to backups
    async def copy(self, pages: Sequence[tuple[str, Page]], tokens: dict[int, int], targets: Sequence[str],
                   ctx: CallContext) -> None:
        """Copy stored ``pages`` to each of ``targets`` (backup homes' addresses), in batches, concurrently;
        a target that fails is counted and logged (the pages have one copy fewer until the next refill)."""
        if not pages or not targets:
            return
        results = await asyncio.gather(*(self._copy_to(a, pages, tokens, ctx) for a in targets),
                                       return_exceptions=True)
        for address, res in zip(targets, results, strict=True):
            if isinstance(res, TensorCastError | OSError | asyncio.TimeoutError):
                self.copy_failures += 1
                log.warning("copying %d KV pages to backup %s failed: %s", len(pages), address, res)
            elif isinstance(res, BaseException):
                raise res

    async def _copy_to(self, address: str, pages: Sequence[tuple[str, Page]], tokens: dict[int, int],
                       ctx: CallContext) -> None:
        start = 0
        while start < len(pages):
            end, total = start, 0
            while end < len(pages) and (end == start or total + pages[end][1].nbytes <= self.batch_bytes):
                total += pages[end][1].nbytes
                end += 1
            batch = pages[start:end]
            now = clock.monotonic()
            release = self.store.hold([p for _, p in batch])
            try:
                shards = {p.shard for _, p in batch}
                msg = KVReplicate(worker_id=self.worker_id, tokens={s: tokens[s] for s in shards if s in tokens},
                                  keys=tuple(k for k, _ in batch), sizes=tuple(p.nbytes for _, p in batch),
                                  ttls=tuple(self.store.ttl_left(p, now) for _, p in batch))
                await self.caller.call(msg, ctx, address=address,
                                       payload=[self.store.view(p) for _, p in batch])
            finally:
                release()
            self.copied += len(batch)
            start = end

    def copy_sink(self, msg: KVReplicate, conn: Connection) -> Landing:
        """A holder's copies land straight in slots here: refused when this home serves one of their shards, or
        keeps pages of a newer tenure (the sender lost it); pages of an older tenure kept here are dropped first."""
        n = self._num_shards()
        if not n:
            raise StaleFencingToken("this shard home has no lease table yet")
        if {shard_of(k, n) for k in msg.keys} - msg.tokens.keys():
            raise InvalidArgument("KVReplicate: a page of a shard without its token")
        now = clock.monotonic()
        for shard in msg.tokens:
            if self._owner_token(shard):
                raise StaleFencingToken(f"shard {shard} is served here: copies go to its backups only")
        for shard, token in msg.tokens.items():
            decision = self.custody.copies(shard, token, msg.worker_id, now)
            if decision is Copies.REFUSE:
                raise StaleFencingToken(f"shard {shard}: pages of a newer tenure than token {token} are kept here")
            if decision is Copies.REPLACE:
                self.store.drop_shard(shard)
        received, views = self.reserve(msg.keys, msg.sizes, msg.ttls, conn)
        return Landing(views, received, lambda: self.abandon(received))

    async def copied_in(self, msg: KVReplicate, req: Request) -> KVPutReply:
        received: Received | None = req.landing
        if received is None:
            if any(msg.sizes):
                raise InvalidArgument("KVReplicate without its page bytes")
            return KVPutReply(stored=0)
        return KVPutReply(stored=self.commit(received))

