"""A tensor-parallel group's swap as a pure state machine: prepare everywhere, then activate everywhere.

Owns: the two-phase protocol a gateway runs over the ranks (bindings) of one engine:

1. **prepare** on every rank (each fetches the new version into staging; live tensors are not touched).
   A retryable failure is retried with exponential backoff while a retry can still finish before the
   commit point; any other failure decides **abort**.
2. The **commit point**: every rank prepared, no later than ``deadline - reserve`` (``reserve``: the time
   the activations need). Later than that, the decision is abort: all ranks stay on the old version.
3. **activate** on every rank (staging -> bound tensors: the only step that touches live tensors). A
   retryable failure is retried while the deadline allows; a rank that cannot be activated is reported
   (the swap is then ``partial``: running the same swap again completes it: a rank whose prepare answers
   that the version is active already counts as activated, and is sent nothing more).
4. **abort** (after an abort decision) goes to every rank once, so that none keeps staging and a late
   prepare of this swap is refused; a failed abort is reported (the rank's staging expires by itself).

One action per rank is in flight at a time. Fed results and the clock; returns the actions to send and
when to wake up. No I/O, no time reads. Does not own: sending anything (``plans.group_swap``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tensorcast.errors import InvalidArgument

__all__ = ["ABORT", "ACTIVATE", "FETCH_MODES", "PREPARE", "GroupSwap", "RankSwap", "fetch_mode"]

PREPARE, ACTIVATE, ABORT = "prepare", "activate", "abort"
FETCH_MODES = ("view", "whole")  # how the ranks' prepares bring a version to their hosts (``client.binding``)
COMMIT, ABORTED = "commit", "abort"
# Rank phases.
PENDING, PREPARED, ACTIVE, FAILED, DROPPED, DROP_FAILED = (
    "pending", "prepared", "active", "failed", "aborted", "abort_failed")


def fetch_mode(ranks: Sequence[str], vias: Mapping[str, str], asked: str | None = None) -> str:
    """How the ranks' prepares bring a version held on another host to theirs: ``asked`` when given; else
    ``"whole"`` when every rank stages through the same worker (``vias``: each rank's binding's ``via``; an
    engine whose ranks are all on one host: that host's worker pulls the version once and each rank slices
    it locally, the same bytes as the ranks' views with fewer requests and no gathering of slices at the
    source), else ``"view"`` (each rank's slices only: ranks spread over hosts, or one unknown)."""
    if asked is not None:
        return asked
    workers = {vias.get(r, "") for r in ranks}
    return "whole" if len(workers) == 1 and "" not in workers else "view"


@dataclass
class RankSwap:
    rank: str
    phase: str = PENDING
    attempts: int = 0  # of the current action
    retry_at: float = 0.0
    in_flight: str = ""  # the action sent and not answered yet
    error: str = ""
    result: dict[str, Any] = field(default_factory=dict)


@dataclass
class GroupSwap:
    ranks: Sequence[str]
    deadline: float | None
    reserve: float = 0.0
    max_attempts: int = 3
    backoff: float = 0.1
    max_backoff: float = 2.0
    decision: str = ""
    reason: str = ""
    state: dict[str, RankSwap] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.ranks or len(set(self.ranks)) != len(self.ranks):
            raise InvalidArgument(f"a group swap needs distinct ranks, got {list(self.ranks)}")
        if self.max_attempts < 1 or self.reserve < 0:
            raise InvalidArgument("max_attempts must be >= 1 and reserve >= 0")
        self.state = {r: RankSwap(r) for r in self.ranks}

    @property
    def commit_by(self) -> float | None:
        return None if self.deadline is None else self.deadline - self.reserve

    # ----------------------------------------------------------------- decisions
    def actions(self, now: float) -> list[tuple[str, str]]:
        """(rank, action) pairs to send now; they count as in flight until ``done``/``failed``."""
        if not self.decision and self.commit_by is not None and now >= self.commit_by:
            self._decide(ABORTED, "the deadline left no time to activate before every rank had prepared")
        out: list[tuple[str, str]] = []
        for r in self.state.values():
            if r.in_flight or r.retry_at > now:
                continue
            action = self._next_action(r)
            if action:
                r.in_flight = action
                r.attempts += 1
                out.append((r.rank, action))
        return out

    def _next_action(self, r: RankSwap) -> str:
        if not self.decision:
            return PREPARE if r.phase == PENDING else ""
        if self.decision == COMMIT:
            return ACTIVATE if r.phase == PREPARED else ""
        return ABORT if r.phase in (PENDING, PREPARED) else ""

    def _decide(self, decision: str, reason: str = "") -> None:
        self.decision, self.reason = decision, reason
        for r in self.state.values():
            r.attempts, r.retry_at = 0, 0.0

    def _delay(self, attempts: int) -> float:
        return float(min(self.backoff * 2.0 ** (attempts - 1), self.max_backoff))

    def done(self, rank: str, action: str, now: float, result: dict[str, Any] | None = None) -> None:
        r = self.state[rank]
        r.in_flight = ""
        if action == PREPARE:
            r.result = dict(result or {})
            if r.result.get("status") == "noop":
                # The rank runs this version already (a retried or repeated swap, or one that completes a
                # partial one): nothing is staged there, so it is neither activated nor aborted.
                r.phase = ACTIVE
            elif self.decision == ABORTED:
                return  # prepared after the decision: its abort is sent next
            else:
                r.phase = PREPARED
            if not self.decision and all(s.phase in (PREPARED, ACTIVE) for s in self.state.values()):
                if self.commit_by is None or now <= self.commit_by:
                    self._decide(COMMIT)
                else:
                    self._decide(ABORTED, "every rank prepared, but too late to activate before the deadline")
        elif action == ACTIVATE:
            r.phase = ACTIVE
            r.result = {**r.result, **(result or {})}
        else:
            r.phase = DROPPED

    def failed(self, rank: str, action: str, retryable: bool, message: str, now: float) -> None:
        r = self.state[rank]
        r.in_flight = ""
        r.error = message
        delay = self._delay(r.attempts)
        if action == PREPARE:
            if self.decision:
                return  # an abort is sent next (or was: the rank is done)
            limit = self.commit_by
            if retryable and r.attempts < self.max_attempts and (limit is None or now + delay < limit):
                r.retry_at = now + delay
                return
            self._decide(ABORTED, f"rank {rank} failed to prepare: {message}")
        elif action == ACTIVATE:
            if retryable and r.attempts < self.max_attempts and (self.deadline is None or now + delay < self.deadline):
                r.retry_at = now + delay
                return
            r.phase = FAILED
        else:
            r.phase = DROP_FAILED

    # ----------------------------------------------------------------- queries
    def next_wakeup(self) -> float | None:
        waits = [r.retry_at for r in self.state.values() if not r.in_flight and self._next_action(r)
                 and r.retry_at > 0]
        if not self.decision and self.commit_by is not None:
            waits.append(self.commit_by)
        return min(waits) if waits else None

    @property
    def finished(self) -> bool:
        if any(r.in_flight for r in self.state.values()) or not self.decision:
            return False
        return not any(self._next_action(r) for r in self.state.values())

    @property
    def status(self) -> str:
        """"activated", "partial" (committed, some ranks failed to activate), "aborted" or "running"."""
        if not self.finished:
            return "running"
        if self.decision == ABORTED:
            return "aborted"
        return "activated" if all(r.phase == ACTIVE for r in self.state.values()) else "partial"

    def report(self) -> dict[str, dict[str, Any]]:
        return {r.rank: {"phase": r.phase, "error": r.error, **r.result} for r in self.state.values()}
