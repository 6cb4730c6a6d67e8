"""A shard home's view of the other homes, followed from the global store: the lease table, and which
shard homes count.

Owns: catching up with the lease table (deltas since (epoch, revision), kept in a ``kv.leases.LeaseMirror``)
and the worker list, one read at a time, and whether the table shows a home holding shards under given
tokens (a hand-over's, confirmed); which shard homes are live (heartbeats within a lease TTL,
``kv.leases.live_homes``; a home that said it is stopping is counted out for a while) and their addresses;
which homes may keep pages to pull (heard from within a few lease TTLs); and whether this home was cut off
from the store (a gap between reads longer than the renew interval), until every live home heartbeated again.
Does not own: what the home makes of it (``kv.home``, ``kv.reconcile``) or the leases it holds
(``kv.leases.HomeLeases``).
"""

from __future__ import annotations

from tensorcast import clock
from tensorcast.config import KVConfig
from tensorcast.context import CallContext
from tensorcast.kv.leases import LeaseMirror, LeaseRecord, live_homes
from tensorcast.wire.caller import Caller
from tensorcast.wire.kv_messages import ListShards, ShardTable
from tensorcast.wire.messages import ListWorkers

__all__ = ["HomeCensus"]


class HomeCensus:
    """``read`` catches up with the store; ``homes`` (the live shard homes, this one included -> address),
    ``peers`` (every other home heard from lately -> address), ``mirror`` and ``cut_off`` are as of the last
    read."""

    def __init__(self, worker_id: str, config: KVConfig, gs: Caller) -> None:
        self.worker_id = worker_id
        self.config = config
        self.gs = gs
        # The lease table as followed from the global store: deltas since (epoch, revision).
        self.mirror = LeaseMirror()
        self.homes: dict[str, str] = {}  # the live shard homes (this one included) -> address
        self.peers: dict[str, str] = {}  # every shard home heard from lately: where pages may be kept
        self._last_read = 0.0  # the store's clock at the last lease-table read
        self.cut_off: tuple[float, float] | None = None  # (last read before a gap, end of its grace)
        self._leaving: dict[str, float] = {}  # homes that said they are stopping -> until when to count them out

    async def read(self, ctx: CallContext) -> tuple[ShardTable, list[str]]:
        """Catch up with the lease table and the live shard homes (this one included, sorted)."""
        mirror = self.mirror
        table = await self.gs.call(ListShards(since=mirror.revision, epoch=mirror.epoch), ctx)
        workers = await self.gs.call(ListWorkers(), ctx)
        # Deltas after the first read (the whole table again only from another global store).
        mirror.apply(table.full, (LeaseRecord(s.shard, s.holder, s.token, s.expiry, s.acquired_at)
                                  for s in table.leases), table.now, table.revision, table.epoch)
        now, ttl = clock.monotonic(), self.config.lease_ttl
        self._leaving = {w: until for w, until in self._leaving.items() if until > now}
        if self._last_read and table.now - self._last_read > self.config.renew_interval:
            self.cut_off = (self._last_read, table.now + ttl)  # cut off from the store until now
        elif self.cut_off is not None and table.now > self.cut_off[1]:
            self.cut_off = None  # every live home heartbeated since
        self._last_read = table.now
        homes = [w for w in workers.workers if "shard-home" in w.roles]
        beats = {w.worker_id: w.last_heartbeat for w in homes if w.worker_id not in self._leaving}
        live = live_homes(beats, table.now, ttl, self.cut_off[0] if self.cut_off else None)
        by_id = {w.worker_id: w.address for w in homes}
        self.homes = {w: by_id[w] for w in live}
        self.homes.setdefault(self.worker_id, "")
        # Pages may be kept by any home heard from within a few lease TTLs (a pull from a dead one fails fast).
        recent = live_homes({w.worker_id: w.last_heartbeat for w in homes}, table.now, 10 * ttl,
                            self.cut_off[0] if self.cut_off else None)
        self.peers = {w: by_id[w] for w in recent if w != self.worker_id and by_id[w]}
        return table, sorted(self.homes)

    def shows(self, worker: str, tokens: dict[int, int]) -> bool:
        """Whether the lease table as last read shows ``worker`` holding these shards under these tokens."""
        recs = self.mirror.records
        return all((r := recs.get(s)) is not None and r.holder == worker and r.token == t
                   for s, t in tokens.items())

    def leaving(self, worker_id: str) -> None:
        """``worker_id`` said it is stopping: it no longer counts as a home (until its hand-over is over)."""
        if worker_id != self.worker_id:
            self._leaving[worker_id] = clock.monotonic() + self.config.handover_timeout + 2 * self.config.lease_ttl
