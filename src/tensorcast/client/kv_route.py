"""Routing a batch of KV keys to the shard homes that hold them, for ``client.kv``.

Owns: the cached shard-lease table (fetched from the global store once, refreshed only when a shard home
rejects a token or is unreachable, or a shard has no holder — O(shards) global-store requests, never per
page), each key's shard (computed once per call), grouping a batch's keys by holder (one request per home,
sent concurrently) with the fencing token of every shard a request touches, which holders share this
host's memory, and bounded retries after a refresh. Each refresh also publishes the table whole as
``routes`` (holder and token per shard), which other threads may read without a lock. Does not own: what a
request does (``client.kv``) or the checks themselves (the shard home checks every token).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorcast import clock
from tensorcast.client.locality import Locality
from tensorcast.config import KVConfig
from tensorcast.context import CallContext
from tensorcast.errors import DeadlineExceeded, StaleFencingToken, Unavailable
from tensorcast.kv.keys import check_keys, shards_of
from tensorcast.records import ShardLease
from tensorcast.wire.caller import Caller
from tensorcast.wire.kv_messages import ListShards, ShardTable

__all__ = ["Attempt", "KVRouter", "Op", "Routes", "next_attempt"]

_RETRYABLE = (StaleFencingToken, Unavailable, DeadlineExceeded)

# One request to one home: its key indexes into the batch, and the fencing token of each shard they fall in.
Group = tuple[list[int], dict[int, int]]
Op = Callable[[str, list[int], dict[int, int]], Awaitable[Any]]


@dataclass(frozen=True)
class Routes:
    """The cached lease table as one immutable value: each shard's holder address (None: no holder) and
    fencing token. Replaced whole by every refresh, so a reader on another thread sees one version."""

    addr: list[str | None]
    tok: np.ndarray[Any, Any]  # uint64 [num_shards]


@dataclass(frozen=True)
class Attempt:
    """What a batch does after one round of requests: the key indexes still without an answer, whether the
    table was read again for orphans, and how long to back off before the next round (None: stop here)."""

    todo: list[int]
    orphans_refreshed: bool
    backoff: float | None


def next_attempt(groups: Sequence[list[int]], results: Sequence[Any], orphans: Sequence[int], *, need_all: bool,
                 orphans_refreshed: bool, attempt: int, left: float) -> Attempt:
    """Decide the next round (pure). ``groups``: each request's key indexes, ``results`` its outcome (a
    retryable error, another error, or an answer); ``orphans``: keys whose shard had no holder; ``left``:
    seconds until ``kv.handover_timeout`` runs out. A retryable error (a stale token, an unreachable or slow
    home) retries its keys; another error is raised; orphans are retried by writes (``need_all``) and, once
    the table was read again, are misses for reads. Backoff doubles from 20 ms up to 250 ms."""
    failed: list[int] = list(orphans) if need_all or not orphans_refreshed else []
    for idx, res in zip(groups, results, strict=True):
        if isinstance(res, _RETRYABLE):
            failed.extend(idx)
        elif isinstance(res, BaseException):
            raise res
    todo = sorted(failed)
    refreshed = orphans_refreshed or bool(orphans)
    done = not todo or left <= 0
    return Attempt(todo, refreshed, None if done else min(0.02 * 2**attempt, 0.25))


class KVRouter:
    def __init__(self, caller: Caller, locality: Locality, config: KVConfig) -> None:
        self.caller = caller
        self.locality = locality
        self.config = config
        self._table: ShardTable | None = None
        self._by_shard: dict[int, ShardLease] = {}
        # Indexed by shard: its holder's address (None: no holder) and fencing token.
        self._addr: list[str | None] = []
        self._tok: list[int] = []
        self._same_host: dict[str, bool] = {}  # holder address -> pages reachable through shared memory
        self.routes: Routes | None = None
        self.table_refreshes = 0

    async def refresh(self, ctx: CallContext | None = None) -> ShardTable:
        """Catch up with the lease table: the changes since the last refresh (the whole table the first time,
        or when the answering global store is another one)."""
        since, epoch = (self._table.revision, self._table.epoch) if self._table is not None else (0, "")
        table = await self.caller.call(ListShards(since=since, epoch=epoch), ctx)
        self._table = table
        if table.full:
            self._by_shard = {}
        self._by_shard.update({lease.shard: lease for lease in table.leases})
        for lease in table.leases:
            if lease.address not in self._same_host:
                self._same_host[lease.address] = self.locality.same_host(lease.host_id)
        addr: list[str | None] = [None] * table.num_shards
        tok = [0] * table.num_shards
        for shard, lease in self._by_shard.items():
            if 0 <= shard < table.num_shards and lease.holder and lease.address:
                addr[shard], tok[shard] = lease.address, lease.token
        self._addr, self._tok = addr, tok
        self.routes = Routes(addr, np.array(tok, np.uint64))
        self.table_refreshes += 1
        return table

    def local(self, address: str) -> bool:
        """Whether the home at ``address`` shares this host's memory (pages are copied, not sent)."""
        return self._same_host.get(address, False)

    def not_local(self, address: str) -> None:
        """Same host id, yet the home's shared memory is not visible here: use the socket path."""
        self._same_host[address] = False

    def ctx(self) -> CallContext:
        """One request to a shard home: a home that does not answer within ``kv.request_timeout`` (paused,
        partitioned) is treated like one that rejected the request: the table is read again."""
        return self.caller.context(self.config.request_timeout)

    async def _shards(self, keys: Sequence[str]) -> list[int]:
        if self._table is None:
            await self.refresh()
        if not self._addr:
            raise Unavailable("the global store reports no KV shards (gs.kv_num_shards)")
        return shards_of(keys, len(self._addr))

    def groups(self, todo: list[int], shards: list[int]) -> tuple[dict[str, Group], list[int]]:
        """Key indexes (of ``todo``) by holder address with their shards' tokens, and the indexes of keys
        whose shard has no holder."""
        addr, tok = self._addr, self._tok
        sub = shards if len(todo) == len(shards) else [shards[i] for i in todo]
        distinct = set(sub)
        homes = {addr[s] for s in distinct}
        if len(homes) == 1:  # one home holds them all (one worker, or a small batch)
            (home,) = homes
            if home is not None:
                return {home: (todo, {s: tok[s] for s in distinct})}, []
        by_home: dict[str, list[int]] = {}
        orphans: list[int] = []
        for i, s in zip(todo, sub, strict=True):
            a = addr[s]
            if a is None:
                orphans.append(i)
            else:
                by_home.setdefault(a, []).append(i)
        return {a: (idx, {s: tok[s] for s in {shards[i] for i in idx}}) for a, idx in by_home.items()}, orphans

    async def run(self, keys: Sequence[str], op: Op, *, need_all: bool) -> list[int]:
        """Apply ``op(address, indexes, tokens)`` to every holder's keys. A rejected token, an unreachable or
        slow home, or a shard without a home (start-up, a failover) is waited out: the lease table is read
        again and the affected keys retried, with a short backoff, for up to ``kv.handover_timeout`` seconds.
        Returns the indexes of keys still without an answer then (for writes, ``need_all``, including those
        whose shard has no holder; reads of such keys are misses once the table was read again)."""
        check_keys(keys)
        shards = await self._shards(keys)
        todo = list(range(len(keys)))
        give_up = clock.monotonic() + self.config.handover_timeout
        attempt = 0
        # Reads of a shard without a holder are misses, once the table was read again (the cached one may be
        # from before a hand-over: the shard has a new holder that nothing told this client about).
        orphans_refreshed = False
        while True:
            groups, orphans = self.groups(todo, shards)
            results: list[Any]
            if len(groups) == 1:  # one request: awaited here, without a task
                ((address, (idx, tokens)),) = groups.items()
                try:
                    results = [await op(address, idx, tokens)]
                except _RETRYABLE as exc:
                    results = [exc]
            else:
                results = await asyncio.gather(*(op(a, idx, tok) for a, (idx, tok) in groups.items()),
                                               return_exceptions=True)
            step = next_attempt([idx for idx, _ in groups.values()], results, orphans, need_all=need_all,
                                orphans_refreshed=orphans_refreshed, attempt=attempt,
                                left=give_up - clock.monotonic())
            if step.backoff is None:
                return step.todo
            todo, orphans_refreshed = step.todo, step.orphans_refreshed
            await asyncio.sleep(step.backoff)
            attempt += 1
            left = give_up - clock.monotonic()
            # Bounded like a request to a home, and by what is left: a refresh that hangs (a lost request, a
            # gateway failing over) must not use up the whole wait.
            with contextlib.suppress(Unavailable, DeadlineExceeded):  # the gateway itself may be failing over
                await self.refresh(self.caller.context(max(0.05, min(self.config.request_timeout, left))))
            if self._addr and len(self._addr) != len(shards):  # another store, another shard count
                shards = shards_of(keys, len(self._addr))
