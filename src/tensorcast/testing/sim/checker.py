"""The simulated cluster's invariants, checked after every delivered request and at the end of a run.

Owns the promises, stated as checks over the processes' real state:
- **one server per shard**: at any instant at most one live home serves a shard (and so at most one per
  fencing token);
- **stale tokens are refused**: a page request a home answered carried, for every shard it touched, the
  token the global store shows for that shard right then, held by that home, unexpired;
- **no wrong bytes**: every page read is the bytes put under its key (``page_for``);
- **nothing acknowledged is lost by an ordinary event**: at the end of a run (faults healed, the cluster
  settled), every acknowledged page is readable unless a home that held it was killed, paused or cut off
  (``at_risk``): joins, drains, store outages, delays, reorders and lost messages lose nothing.
A broken promise raises ``InvariantBroken`` naming it. Does not own: the faults (``sim.scenario``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from tensorcast import clock
from tensorcast.kv.keys import shard_of
from tensorcast.testing.sim.net import Delivery
from tensorcast.wire.kv_messages import KVCommit, KVExists, KVGet, KVPut

if TYPE_CHECKING:
    from tensorcast.testing.sim.cluster import SimCluster, SimWorker

__all__ = ["Checker", "InvariantBroken", "lease_table", "page_for"]

PAGE_BYTES = 512
# Debugging a seed: the homes storing this page, logged whenever they change (TENSORCAST_SIM_TRACE_KEY).
TRACE = os.environ.get("TENSORCAST_SIM_TRACE_KEY", "")
log = logging.getLogger("tensorcast.sim")
_FENCED = (KVPut, KVCommit, KVGet, KVExists)


class InvariantBroken(AssertionError):
    pass


def page_for(key: str) -> np.ndarray:
    """A page's bytes are a function of its key: a wrong page is always recognized."""
    seed = xxhash.xxh3_64_intdigest(key.encode())
    return np.random.default_rng(seed).integers(0, 256, PAGE_BYTES, dtype=np.uint8)


def lease_table(cluster: SimCluster) -> dict[int, tuple[str, int, float]]:
    """The global store's shard leases as its database holds them now: shard -> (holder, token, expiry)."""
    db = cluster.backend.db
    return {r[0]: (r[1], r[2], r[3]) for r in db.execute("SELECT shard, holder, token, expiry FROM shard_leases")}


class Checker:
    """Checks after every request the network delivers; the first broken promise is kept in ``failure``
    (raised by the run: raising inside a delivery would reach a loop that logs it and carries on)."""

    def __init__(self, cluster: SimCluster) -> None:
        self.cluster = cluster
        self.acked: set[str] = set()
        self.at_risk: set[str] = set()
        self.checks = 0
        self.failure: InvariantBroken | None = None
        self._traced: list[str] = []
        self.stored_at: dict[str, list[tuple[float, str, int]]] = {}  # key -> (time, home, token) of its puts
        cluster.net.observe = self.delivered

    # ----------------------------------------------------------------- after every step
    def delivered(self, d: Delivery) -> None:
        self.checks += 1
        if TRACE:
            where = sorted(w.id for w in self.cluster.live() if TRACE in w.home.store.index)
            if where != self._traced:
                log.debug("TRACE %s now on %s (after %s %s->%s)", TRACE, where, type(d.message).__name__, d.src, d.dst)
                self._traced = where
        try:
            self.one_server_per_shard()
            if isinstance(d.message, _FENCED) and not isinstance(d.reply, Exception):
                self._current_tokens(d)
                if isinstance(d.message, KVPut) and not d.message.same_host:
                    n = self.cluster.settings.num_shards
                    for key in d.message.keys:
                        self.stored_at.setdefault(key, []).append(
                            (d.at - 10_000, d.dst, d.message.tokens.get(shard_of(key, n), 0)))
        except InvariantBroken as exc:
            if self.failure is None:
                self.failure = InvariantBroken(f"at {clock.monotonic() - 10_000:.3f}s after {type(d.message).__name__}"
                                               f" {d.src}->{d.dst}: {exc}")

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def one_server_per_shard(self) -> None:
        serving: dict[int, list[str]] = {}
        for w in self.cluster.live():
            if w.proc.paused:
                continue
            for shard in list(w.home.leases.held):
                if w.home.served.token(shard):
                    serving.setdefault(shard, []).append(w.id)
        two = {s: ws for s, ws in serving.items() if len(ws) > 1}
        if two:
            raise InvariantBroken(f"shards served by two homes at once: {two}")

    def _current_tokens(self, d: Delivery) -> None:
        n = self.cluster.settings.num_shards
        shards = {shard_of(k, n) for k in d.message.keys}
        table = lease_table(self.cluster)
        now = clock.time()
        for shard in shards:
            sent = d.message.tokens.get(shard)
            holder, token, expiry = table.get(shard, ("", 0, 0.0))
            if sent != token or holder != d.dst or expiry <= now:
                raise InvariantBroken(f"{type(d.message).__name__} served by {d.dst} for shard {shard} under token "
                                      f"{sent}; the store shows {holder!r} token {token} expiring {expiry - now:+.3f}s")

    # ----------------------------------------------------------------- reads and faults
    def read(self, keys: Iterable[str], got: Iterable[np.ndarray | None]) -> int:
        hits = 0
        for key, page in zip(keys, got, strict=True):
            if page is None:
                continue
            if not np.array_equal(page, page_for(key)):
                raise InvariantBroken(f"page {key} read with bytes other than those put")
            hits += 1
        return hits

    def risk(self, worker: SimWorker) -> None:
        """``worker`` is paused or cut off: what it holds may be lost (left behind by a hand-over)."""
        self.at_risk |= set(worker.home.store.index)

    def killed(self, worker: SimWorker) -> None:
        """``worker`` is killed: the pages no other live home keeps a copy of (a backup, kept pages) may be lost."""
        others: set[str] = set()
        for w in self.cluster.live():
            if w is not worker:
                others |= set(w.home.store.index)
        self.at_risk |= set(worker.home.store.index) - others

    def lost(self, missing: Iterable[str]) -> list[str]:
        """The acknowledged pages among ``missing`` that no fault put at risk."""
        return sorted(k for k in missing if k in self.acked and k not in self.at_risk)
