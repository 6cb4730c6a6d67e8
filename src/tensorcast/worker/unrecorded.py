"""Local copies that a put stored and the global store has no record of: kept track of, then recorded or dropped.

A put is stored on the worker first (``worker.puts``), then recorded at the global store (``worker.storage``).
When that record fails (the store is down or unreachable, the call ran past its deadline or was cancelled),
the caller's put fails and its ``PutAbort`` finds nothing to undo: the copy stored here would serve no reader
and never be dropped. Dropping it at once is not safe: another put of the same bytes may count on it (one that
found it here and stored nothing, one whose record the store took meanwhile), and the failed record itself may
have reached the store after all (a lost reply).

Owns: the artifact ids whose local copy may be unrecorded (only puts that stored a tier themselves add one),
the count of puts that are between their local commit and their store commit (those still in the local
commit, whose artifact may not be known yet, and those past it, per artifact), and settling the ids, in the
storage role's housekeeping: once the failed commit can no longer reach the store (its deadline passed,
``settle_after``) and no put could count on the copy (``may_drop``), the worker asks the store to record the
tiers it holds (``AddReplica``, one request: the store's answer and the record are one step there). Recorded
(the store knows the artifact: another put of the same bytes, or the failed commit landed after all): the id
is forgotten. ``NotFound``: the copy is dropped, unless a put of the artifact committed here while the answer
was on its way (its record may postdate the answer): then it is asked again. The store unreachable: asked
again next round. Does not own: storing or dropping bytes (``worker.store``, ``StorageRole.drop``), the put
protocol (``worker.puts``), re-announcing replicas after a registration (``StorageRole.announce``, which leaves
these ids to the settling).

Not covered: the ids are kept in memory only. A worker killed between a put's local commit and its store
commit, or before it settled an id (the store still down), finds the disk copy again when it restarts, and
``StorageRole.announce`` records it (``commit_artifact(restored=True)``, no key) as an anonymous artifact.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from tensorcast import clock
from tensorcast.context import CallContext
from tensorcast.errors import DeadlineExceeded, NotFound, TensorCastError, Unavailable
from tensorcast.worker.gs_link import GlobalStoreLink
from tensorcast.worker.puts import PendingPut, PutManager
from tensorcast.worker.store import LocalStore

__all__ = ["UnrecordedCopies", "may_drop", "settle_after"]

log = logging.getLogger("tensorcast.worker")

# Seconds a settling request to the store may take (the next round asks again).
_ASK_TIMEOUT = 2.0
# Added to a failed commit's deadline: the store compares it with its own clock.
_CLOCK_SKEW = 2.0
# A failed commit without a deadline: how long it may still reach the store.
_NO_DEADLINE_GRACE = 60.0


def settle_after(deadline: float | None, now: float) -> float:
    """When the store's answer about an artifact whose commit failed at ``now`` is final: the commit can no
    longer start there (a request past its deadline is refused before its handler runs, one running at it is
    cancelled; ``wire.rpc``), with a margin for the clocks of two hosts."""
    return (now + _NO_DEADLINE_GRACE if deadline is None else max(deadline, now)) + _CLOCK_SKEW


def may_drop(artifact_id: str, committing: int, in_flight: Mapping[str, int], pending: Collection[str]) -> bool:
    """No put could count on the local copy of ``artifact_id`` now: none is in its local commit (``committing``:
    its artifact may not be known yet, or it may have found the copy here and stored nothing), none of it is
    between its local and its store commit (``in_flight``), and none of it is begun (``pending``: one that
    found the copy here would store nothing at its commit)."""
    return committing == 0 and not in_flight.get(artifact_id, 0) and artifact_id not in pending


@dataclass
class _Unrecorded:
    settle_after: float  # ``clock.time()`` from which the store's answer is final
    generation: int = 0  # local commits of the artifact since: an answer asked for before them may be stale


class UnrecordedCopies:
    """``drop``: forget every local copy of an artifact (``StorageRole.drop``)."""

    def __init__(self, store: LocalStore, puts: PutManager, gs: GlobalStoreLink, drop: Callable[[str], None]) -> None:
        self.store = store
        self.puts = puts
        self.gs = gs
        self.drop = drop
        self.ids: dict[str, _Unrecorded] = {}
        self.committing = 0  # puts in ``PutManager.commit``
        self.in_flight: collections.Counter[str] = collections.Counter()  # past it, before their store commit

    def __contains__(self, artifact_id: object) -> bool:
        return artifact_id in self.ids

    async def commit_locally(self, put_id: str, digests: tuple[str, ...]) -> PendingPut:
        """``PutManager.commit``, counted while it runs and from its return (nothing awaits in between) until
        ``store_commit_ended``, which the caller must call once it returned."""
        self.committing += 1
        try:
            put = await self.puts.commit(put_id, digests)
        finally:
            self.committing -= 1
        self.in_flight[put.artifact_id] += 1
        entry = self.ids.get(put.artifact_id)
        if entry is not None:
            entry.generation += 1
        return put

    def store_commit_ended(self, put: PendingPut, recorded: bool, deadline: float | None) -> None:
        """The put's commit at the store ended (``deadline``: that request's). Not ``recorded``, and this put
        stored a tier here: its artifact's copy may be unrecorded."""
        aid = put.artifact_id
        self.in_flight[aid] -= 1
        if self.in_flight[aid] <= 0:
            del self.in_flight[aid]
        if not recorded and (put.to_memory or put.to_disk):
            after = settle_after(deadline, clock.time())
            entry = self.ids.setdefault(aid, _Unrecorded(after))
            entry.settle_after = max(entry.settle_after, after)
            log.warning("artifact %s is stored here but not recorded at the global store: settled from %+.1fs",
                        aid, entry.settle_after - clock.time())

    def _quiet(self, artifact_id: str) -> bool:
        pending = {p.artifact_id for p in self.puts.pending.values()}
        return may_drop(artifact_id, self.committing, self.in_flight, pending)

    async def settle(self) -> None:
        """Record or drop the copies whose time came (housekeeping); stops at the first request the store does
        not answer (the rest wait for the next round)."""
        now = clock.time()
        for aid in [a for a, e in self.ids.items() if e.settle_after <= now]:
            entry = self.ids.get(aid)
            tiers = self.store.tiers(aid)
            if entry is None or not tiers:  # evicted or dropped meanwhile: nothing left to record
                self.ids.pop(aid, None)
                continue
            if not self._quiet(aid):
                continue
            seen = entry.generation
            try:
                await self.gs.add_replica(aid, tiers, CallContext(deadline=clock.time() + _ASK_TIMEOUT))
            except NotFound as exc:
                if self.ids.get(aid) is entry and entry.generation == seen and self._quiet(aid):
                    log.info("dropping artifact %s, stored here by a put the global store never recorded: %s",
                             aid, exc.message)
                    del self.ids[aid]
                    self.drop(aid)
                continue
            except (Unavailable, DeadlineExceeded) as exc:
                log.info("cannot settle unrecorded artifacts yet: %s", exc)
                return
            except TensorCastError as exc:
                log.warning("settling unrecorded artifact %s failed (asked again): %s", aid, exc)
                continue
            if self.ids.get(aid) is entry and entry.generation == seen:  # else asked again: tiers may have come
                log.info("recorded artifact %s (tiers %s), stored here by a put whose record failed", aid,
                         ",".join(tiers))
                del self.ids[aid]
