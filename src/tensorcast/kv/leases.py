"""Shard leases and fencing tokens as pure rules: the global store's grant/renew/release decisions and a
shard home's view of what it holds, may serve, and should ask for next.

Global store (``grant``, ``renew``, ``release``): a lease is granted to the first candidate that asks
while the shard is vacant or its lease expired, and every change of holder increments the shard's
**fencing token**; the holder extends it by renewing with its current token.

Shard home (``HomeLeases``): a shard may be served only while ``now < local_expiry`` (the renew was *sent*
at ``t``, so the local expiry ``t + ttl`` is never later than the store's) and only for requests carrying
its current token. A home that was paused past its lease therefore refuses everything on waking, before
it has even talked to the store. Fed events and a clock value, returning decisions; no I/O.

Following the table (``LeaseFeed`` at the store, ``LeaseMirror`` at a reader): readers ask for what changed
since their last read, and a renewal is not a change, so a settled cluster's reads carry nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from tensorcast.errors import StaleFencingToken
from tensorcast.kv.hrw import candidates

__all__ = ["HeldShard", "HomeLeases", "LeaseFeed", "LeaseMirror", "LeaseRecord", "grant", "live_homes", "release",
           "renew"]


@dataclass(frozen=True)
class LeaseRecord:
    shard: int
    holder: str
    token: int
    expiry: float
    acquired_at: float = 0.0


def grant(rec: LeaseRecord | None, shard: int, worker: str, now: float, ttl: float) -> LeaseRecord | None:
    """The store's answer to ``worker`` asking for ``shard``: the new record, or None (held by another)."""
    if rec is None:
        return LeaseRecord(shard, worker, 1, now + ttl, now)
    if rec.holder == worker and rec.expiry > now:
        return replace(rec, expiry=now + ttl)
    if not rec.holder or rec.expiry <= now:
        return LeaseRecord(shard, worker, rec.token + 1, now + ttl, now)
    return None


def renew(rec: LeaseRecord | None, worker: str, token: int, now: float, ttl: float) -> LeaseRecord | None:
    if rec is not None and rec.holder == worker and rec.token == token and rec.expiry > now:
        return replace(rec, expiry=now + ttl)
    return None


def release(rec: LeaseRecord | None, worker: str, token: int) -> LeaseRecord | None:
    """Give a lease back early (the next grant increments the token)."""
    if rec is not None and rec.holder == worker and rec.token == token:
        return replace(rec, holder="", expiry=0.0)
    return None


def live_homes(heartbeats: Mapping[str, float], now: float, ttl: float, cut_off: float | None = None) -> list[str]:
    """The shard homes to rank (sorted): those whose last heartbeat (the store's clock) is within ``ttl`` of
    ``now``, so a dead home drops out by the time its leases expire. ``cut_off``: when the reading home last
    reached the store before it was cut off from it (the store was down, or the network between them); the
    other homes' heartbeats could not arrive then either, so those heard within ``ttl`` before it count too,
    instead of every home seeing itself alone and taking every shard."""
    since = now - ttl if cut_off is None else min(now, cut_off) - ttl
    return sorted(w for w, at in heartbeats.items() if at > since)


@dataclass
class HeldShard:
    token: int
    local_expiry: float  # monotonic


@dataclass
class HomeLeases:
    worker_id: str
    k: int = 3
    held: dict[int, HeldShard] = field(default_factory=dict)
    # Seconds before the store's expiry at which this home stops serving (kv.lease_margin).
    margin: float = 0.0

    def check(self, shard: int, token: int, now: float) -> None:
        """Refuse a request unless this home holds ``shard`` under ``token`` right now."""
        h = self.held.get(shard)
        if h is None or now >= h.local_expiry:
            raise StaleFencingToken(f"this worker does not hold a live lease on shard {shard}")
        if token != h.token:
            raise StaleFencingToken(f"shard {shard}: request token {token}, current token {h.token}")

    def plan(self, leases: Mapping[int, LeaseRecord], homes: Iterable[str], num_shards: int, gs_now: float,
             grace: float, takeover: bool = True) -> tuple[list[int], list[int]]:
        """(shards to acquire, shards to release) given the store's table and the live shard homes.

        The rank-0 candidate among the live homes asks for a vacant or expired shard at once; rank r asks
        once the lease has been expired for ``r * grace`` (the store arbitrates anyway; this only avoids
        pointless contention). ``homes`` must hold only live homes, so a dead home never ranks first.
        A holder that is no longer a candidate, or that a live better-ranked candidate outranks while
        the shard is still in its hands, gives it back so the assignment converges to HRW. ``takeover=False``
        (just after the store was unreachable: every lease expired at once, their holders alive) leaves the
        expired shards of other live homes to them.
        """
        live = sorted(set(homes))
        acquire: list[int] = []
        give_back: list[int] = []
        for shard in range(num_shards):
            ranked = candidates(shard, live, self.k)
            rec = leases.get(shard)
            mine = self.worker_id in ranked
            held = shard in self.held
            if held:
                # ``homes`` are the shard homes heartbeating within a lease TTL, so a dead better
                # candidate drops out of ``ranked`` no later than its leases expire: no flapping.
                if not mine or ranked[0] != self.worker_id:
                    give_back.append(shard)
                continue
            if not mine:
                continue
            rank = ranked.index(self.worker_id)
            vacant = rec is None or not rec.holder or rec.expiry <= gs_now
            if not vacant:
                continue
            # The best live candidate asks at once. A lower-ranked one asks only if the holder's lease
            # has been expired for rank * grace (the better candidates had their chance) — never for a
            # shard that was released or never leased while a better candidate is alive.
            expired_long = takeover and rec is not None and bool(rec.holder) and gs_now - rec.expiry >= rank * grace
            if rank == 0 or expired_long:
                acquire.append(shard)
        return acquire, give_back

    def granted(self, shard: int, token: int, sent_at: float, ttl: float) -> None:
        """The store granted or renewed ``shard`` for ``ttl`` seconds from when it received the request, which
        was after ``sent_at``: the lease is served until ``sent_at + ttl - margin``, before it can expire there."""
        self.held[shard] = HeldShard(token, sent_at + ttl - self.margin)

    def lost(self, shard: int) -> None:
        self.held.pop(shard, None)

    def expired(self, now: float) -> list[int]:
        return [s for s, h in self.held.items() if now >= h.local_expiry]


class LeaseFeed:
    """Numbers the changes of a lease table so that readers can ask what changed since they last looked.

    ``observe`` takes the current table and the store's clock (records in, no I/O). A record gets the next
    revision when its holder, token or liveness changed: granted, released, handed over, or seen expired.
    A renewal only moves a live lease's expiry, so it is kept without a new revision: with every home
    renewing every tick, counting renewals would make each delta the whole table (shards x homes per
    tick). ``since(epoch, revision)`` answers with the shards changed after that revision, or all of them
    (``full``) when the reader's numbering is another feed's (``epoch``)."""

    def __init__(self, epoch: str) -> None:
        self.epoch = epoch
        self.revision = 0
        self._states: dict[int, tuple[str, int, float, bool]] = {}  # shard -> its state when last observed
        self._changed_at: dict[int, int] = {}

    def observe(self, table: Mapping[int, LeaseRecord], now: float) -> None:
        for shard, rec in table.items():
            state = (rec.holder, rec.token, rec.acquired_at, rec.expiry > now)  # all but a live expiry
            if self._states.get(shard) != state:
                self._states[shard] = state
                self.revision += 1
                self._changed_at[shard] = self.revision

    def since(self, epoch: str, revision: int) -> tuple[bool, list[int]]:
        """(full, shards): every shard when ``epoch`` is not this feed's, else those changed after
        ``revision``."""
        if epoch != self.epoch or revision <= 0 or revision > self.revision:
            return True, sorted(self._states)
        return False, sorted(s for s, r in self._changed_at.items() if r > revision)


class LeaseMirror:
    """A reader's copy of a global store's lease table, followed through ``LeaseFeed`` deltas.

    The feed does not report renewals, so a lease reported live is taken as live (expiry at infinity) until
    the store reports its change; an expired lease is reported with its real expiry, which the lower-ranked
    candidates' wait (``HomeLeases.plan``) counts from. Records in; no I/O."""

    def __init__(self) -> None:
        self.records: dict[int, LeaseRecord] = {}
        self.revision, self.epoch = 0, ""

    def apply(self, full: bool, records: Iterable[LeaseRecord], now: float, revision: int, epoch: str) -> None:
        """Merge one answer: ``records`` as of the store's clock ``now``, the whole table when ``full``."""
        if full:
            self.records = {}
        for rec in records:
            self.records[rec.shard] = rec if rec.expiry <= now else replace(rec, expiry=math.inf)
        self.revision, self.epoch = revision, epoch
