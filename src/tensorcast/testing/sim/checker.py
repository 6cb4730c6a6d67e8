"""The simulated cluster's invariants, checked after every delivered request and at the end of a run.

Owns the promises, stated as checks over the processes' real state:
- **one server per shard**: at any instant at most one live home serves a shard (and so at most one per
  fencing token);
- **stale tokens are refused**: a page request a home answered carried, for every shard it touched, the
  token the global store shows for that shard right then, held by that home, unexpired;
- **no wrong bytes**: every page read is the bytes put under its key (``page_for``);
- **nothing acknowledged is lost by an ordinary event**: at the end of a run (faults healed, the cluster
  settled), every acknowledged page is readable unless a home that held it was killed, paused or cut off
  (``at_risk``): joins, drains, store outages, delays, reorders and lost messages lose nothing;
- **artifacts** (``ArtifactLedger``): no read returns bytes other than those put (``artifact_bytes``); at the
  end of a run every acknowledged durable put is readable under its key unless every worker whose disk held it
  is gone (its machine lost, or stopped for good); a key whose delete was acknowledged is gone, and its
  siblings (other keys of the same bytes) are not.
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

__all__ = ["ArtifactLedger", "Checker", "InvariantBroken", "artifact_bytes", "lease_table", "page_for"]

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


def stem_of(key: str) -> str:
    """The part of an artifact key its bytes depend on: sibling keys (``.../a``, ``.../b``) name the same bytes."""
    return key.rsplit("/", 1)[0]


def artifact_bytes(key: str) -> np.ndarray:
    """An artifact's bytes are a function of its key's stem: a wrong artifact is always recognized. One stem in
    eight is larger than an inline put (``client.put_path``), so that streamed puts run too."""
    seed = xxhash.xxh3_64_intdigest(stem_of(key).encode())
    nbytes = (300 << 10) if seed % 8 == 0 else 1024 + seed % (16 << 10)
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


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
        self.artifacts = ArtifactLedger(cluster)
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


class ArtifactLedger:
    """What was promised about artifacts: the durable puts acknowledged (key -> artifact id), the deletes
    acknowledged, and the keys whose every holder's disk is gone (which may then be lost)."""

    def __init__(self, cluster: SimCluster) -> None:
        self.cluster = cluster
        self.acked: dict[str, str] = {}
        self.deleted: set[str] = set()
        self.unsure: set[str] = set()  # a delete that got no answer: it may or may not have happened
        self.at_risk: set[str] = set()
        self.gone: set[str] = set()  # workers whose disk will never be read again
        self.read_back = 0

    def check(self, key: str, got: np.ndarray) -> None:
        if not np.array_equal(np.asarray(got).reshape(-1).view(np.uint8), artifact_bytes(key)):
            raise InvariantBroken(f"artifact {key} read with bytes other than those put")
        self.read_back += 1

    def ack(self, key: str, artifact_id: str) -> None:
        """A durable put of ``key`` was acknowledged. One answered just before its worker stopped for good
        (the answer was on its way) is at risk at once when only gone disks hold it."""
        self.acked[key] = artifact_id
        holders = {w.id for w in self.cluster.workers.values() if artifact_id in self._on_disk(w)}
        if holders and holders <= self.gone:
            self.at_risk.add(key)

    def must_read(self) -> list[str]:
        return sorted(k for k in self.acked if k not in self.deleted and k not in self.unsure)

    def _on_disk(self, worker: SimWorker) -> set[str]:
        """The artifacts on ``worker``'s disk that the global store knows it holds there: a copy the store has
        no record of (a put whose commit at the store failed) serves no reader."""
        disk = worker.storage.store.disk
        known = {r[0] for r in self.cluster.backend.db.execute(
            "SELECT artifact_id FROM replicas WHERE worker_id=? AND tier='disk'", (worker.id,))}
        return set(disk.manifests) & known if disk is not None else set()

    def disk_gone(self, worker: SimWorker) -> None:
        """``worker``'s disk will never be read again (its machine is lost, or it stopped for good): the keys
        no other worker's disk holds may be lost."""
        self.gone.add(worker.id)
        mine, others = self._on_disk(worker), set()
        for w in self.cluster.workers.values():
            if w.id not in self.gone:
                others |= self._on_disk(w)
        self.at_risk |= {k for k, aid in self.acked.items() if aid in mine and aid not in others}

    def lost(self, missing: Iterable[str]) -> list[str]:
        """The acknowledged keys among ``missing`` that no fault put at risk."""
        return sorted(k for k in missing if k in self.acked and k not in self.at_risk)

    def where(self, key: str) -> str:
        aid = self.acked.get(key, "")
        held = {w.id: (w.alive, w.storage.store.tiers(aid)) for w in self.cluster.workers.values()
                if w.storage.store.tiers(aid)}
        return f"artifact {aid} held on {held or 'no worker'} (gone disks: {sorted(self.gone)})"
