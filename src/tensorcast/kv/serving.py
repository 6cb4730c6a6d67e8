"""A shard home's page requests: ``KVPut``/``KVCommit``/``KVGet``/``KVRelease``/``KVExists``.

Owns: the handlers — every request's fencing tokens checked first (``check``, the home's live leases), page
bytes received straight into their slab slots (scatter) and sent straight from them (gather) under read
leases, same-host reservations and read leases (reclaimed when their caller never comes back), and, with
backups (``kv.replicas`` > 1), the copy of every stored page to the shard's backups before the put is
acknowledged (``copy``). Does not own: the leases (``kv.home``), moving pages between homes
(``kv.handover``) or the page store (``kv.pages``).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tensorcast import clock
from tensorcast.errors import AlreadyExists, InvalidArgument, NotFound, StaleFencingToken, clip
from tensorcast.kv.pages import Page, PageStore, check_page_sizes
from tensorcast.limits import check_ttl
from tensorcast.obs import metrics
from tensorcast.wire.connection import Connection, Landing
from tensorcast.wire.kv_messages import (
    KVCommit,
    KVExists,
    KVExistsReply,
    KVGet,
    KVGetReply,
    KVPut,
    KVPutReply,
    KVRelease,
)
from tensorcast.wire.messages import Ack
from tensorcast.wire.rpc import HandlerRegistry, Reply, Request

__all__ = ["PageService"]

# Same-host reservations and read leases not committed/released within this long are reclaimed.
SAME_HOST_TIMEOUT = 60.0

Check = Callable[[tuple[str, ...], dict[int, int]], list[int]]
Copy = Callable[[list[tuple[str, Page]], dict[int, int]], Awaitable[None]]


@dataclass
class _PendingPut:
    pages: list[tuple[str, Page] | None]  # None: the page was already stored (bytes discarded)
    started: float
    ttl: float | None = None
    done: bool = False  # committed or abandoned: its slots are no longer this put's
    scratch: list[Callable[[], None]] = field(default_factory=list)  # receive budget held for dropped bytes
    # Pages already stored, whose bytes arrive again: (key, the stored page, where the new bytes land), compared
    # before anything is committed (a key names one page: different bytes under it are refused, same ones kept).
    again: list[tuple[str, Page, memoryview]] = field(default_factory=list)

    def release_scratch(self) -> None:
        for release in self.scratch:
            release()
        self.scratch.clear()


def _same_bytes(a: memoryview, b: memoryview) -> bool:
    """Byte equality at memcmp speed (a memoryview comparison goes element by element, 4x slower)."""
    return a.nbytes == b.nbytes and bool(np.array_equal(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8)))


class PageService:
    """``check(keys, tokens)``: the shard of every key, once each token was checked against a live lease
    (raises ``StaleFencingToken``); ``copy(pages, tokens)``: the backups' copies of stored pages, or None."""

    def __init__(self, store: PageStore, check: Check, copy: Copy | None = None, *,
                 max_request_bytes: int = 64 << 20) -> None:
        self.store = store
        self.max_request_bytes = max_request_bytes
        self.check = check
        self.copy = copy
        self._reservations: dict[str, _PendingPut] = {}  # same-host puts awaiting KVCommit
        self._read_leases: dict[str, tuple[float, Callable[[], None]]] = {}  # same-host gets awaiting KVRelease

    def register(self, registry: HandlerRegistry) -> None:
        registry.register(KVPut, self.put, sink=self.put_sink)
        registry.register(KVCommit, self.commit)
        registry.register(KVGet, self.get)
        registry.register(KVRelease, self.release)
        registry.register(KVExists, self.exists)

    # ----------------------------------------------------------------- puts
    def _reserve(self, msg: KVPut, conn: Connection | None) -> tuple[_PendingPut, list[memoryview]]:
        """Slots for a put's new pages. With ``conn`` (the bytes will arrive on it), also where each page's
        bytes land: a page already stored is received into scratch charged to the receive budget, then
        dropped. Sizes are checked before anything is reserved or allocated."""
        if len(msg.keys) != len(msg.sizes):
            raise InvalidArgument("keys and sizes differ in length")
        if msg.ttl is not None:
            check_ttl(msg.ttl)
        shards = self.check(msg.keys, msg.tokens)
        check_page_sizes(msg.sizes, self.store.max_page_bytes, self.max_request_bytes)
        now = clock.monotonic()
        pending = _PendingPut([], clock.monotonic(), msg.ttl)
        views: list[memoryview] = []
        try:
            with self.store.batch():  # pages evicted to make room leave the presence table in one step
                for key, size, shard in zip(msg.keys, msg.sizes, shards, strict=True):
                    stored = self.store.index.get(key) if self.store.contains(key, now) else None
                    if stored is not None:  # same key: keep the stored page, compare these bytes, drop them
                        if stored.nbytes != size:
                            raise AlreadyExists(f"page key {clip(key)} holds a page of {stored.nbytes} bytes; "
                                                f"a put of {size} bytes under it is refused")
                        pending.pages.append(None)
                        if conn is not None:
                            view, release = conn.scratch(size)
                            pending.scratch.append(release)
                            pending.scratch.append(self.store.hold([stored]))  # its slot stays until compared
                            pending.again.append((key, stored, view))
                            views.append(view)
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
        pending.release_scratch()
        if pending.done:
            return
        pending.done = True
        for entry in pending.pages:
            if entry is not None:
                self.store.abandon(entry[1])

    def put_sink(self, msg: KVPut, conn: Connection) -> Landing:
        """The pages' bytes land straight in their reserved slots; if the request fails before ``put``
        commits them (a checksum, a lost connection, a stale token), the slots are given back."""
        pending, views = self._reserve(msg, conn)
        return Landing(views, pending, lambda: self._abandon(pending))

    async def put(self, msg: KVPut, req: Request) -> KVPutReply:
        if msg.same_host:
            reserved, _ = self._reserve(msg, None)
            rid = uuid.uuid4().hex
            self._reservations[rid] = reserved
            slots = self.store.slot_list([None if entry is None else entry[1] for entry in reserved.pages])
            return KVPutReply(stored=0, slots=slots, reservation=rid)
        pending: _PendingPut | None = req.landing
        if pending is None:
            self.check(msg.keys, msg.tokens)
            if any(msg.sizes):
                raise InvalidArgument("KVPut without its page bytes")
            return KVPutReply(stored=0)
        try:
            self.check(msg.keys, msg.tokens)  # the lease may have been lost while the bytes arrived
        except StaleFencingToken:
            self._abandon(pending)
            raise
        return KVPutReply(stored=await self._commit(pending, msg.tokens))

    async def _commit(self, pending: _PendingPut, tokens: dict[int, int]) -> int:
        for key, stored, received in pending.again:
            if not _same_bytes(self.store.view(stored), received):
                self._abandon(pending)
                raise AlreadyExists(f"page key {clip(key)} holds other bytes; a key names one page, so a put of "
                                    "different bytes under it is refused (the same bytes are accepted)")
        pending.done = True
        pending.release_scratch()
        pages = [entry for entry in pending.pages if entry is not None]
        self.store.commit_many(pages, pending.ttl, clock.monotonic())
        metrics.kv_pages("put", len(pages))
        if self.copy is not None and pages:
            await self.copy(pages, tokens)  # acknowledged once the backups have them too
            # Acknowledged only under a lease still held: if it was lost while the copies went out, the caller
            # asks the shard's next holder (which took these pages with the rest, or stores them again).
            self.check(tuple(k for k, _ in pages), tokens)
        return len(pages)

    async def commit(self, msg: KVCommit, req: Request) -> KVPutReply:
        pending = self._reservations.pop(msg.reservation, None)
        if pending is None:
            raise NotFound(f"no KV reservation {msg.reservation} (committed, expired or lost with a lease)")
        try:
            self.check(msg.keys, msg.tokens)
        except StaleFencingToken:
            self._abandon(pending)
            raise
        return KVPutReply(stored=await self._commit(pending, msg.tokens))

    # ----------------------------------------------------------------- reads
    async def get(self, msg: KVGet, req: Request) -> Reply:
        self._release(msg.release)
        self.check(msg.keys, msg.tokens)
        found = self.store.get_many(msg.keys, clock.monotonic())
        sizes = tuple(-1 if page is None else page.nbytes for page in found)
        hits = [page for page in found if page is not None]
        metrics.kv_pages("get", len(hits), len(found) - len(hits))
        release = self.store.hold(hits)
        if msg.same_host:  # the caller copies from the slots, then releases the read lease
            lease = uuid.uuid4().hex
            self._read_leases[lease] = (clock.monotonic(), release)
            return Reply(KVGetReply(sizes=sizes, slots=self.store.slot_list(hits), lease=lease))
        views = [self.store.view(page) for page in hits]
        return Reply(KVGetReply(sizes=sizes), payload=views or None, on_sent=release)

    async def release(self, msg: KVRelease, req: Request) -> Ack:
        self._release(msg.leases)
        return Ack()

    def _release(self, leases: Sequence[str]) -> None:
        for lease in leases:
            held = self._read_leases.pop(lease, None)
            if held is not None:
                held[1]()

    async def exists(self, msg: KVExists, req: Request) -> KVExistsReply:
        self.check(msg.keys, msg.tokens)
        present = self.store.present(msg.keys, clock.monotonic())
        hits = present.count(1)
        metrics.kv_pages("exists", hits, len(present) - hits)
        table = self.store.presence
        return KVExistsReply(present=present, presence=table.path if table is not None else "")

    def reap(self) -> None:
        """Reservations whose bytes never arrived, and same-host leases never released (the caller died)."""
        cutoff = clock.monotonic() - SAME_HOST_TIMEOUT
        for res in [r for r, p in self._reservations.items() if p.started < cutoff]:
            self._abandon(self._reservations.pop(res))
        for lease in [r for r, (t, _) in self._read_leases.items() if t < cutoff]:
            self._read_leases.pop(lease)[1]()
