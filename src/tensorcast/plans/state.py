"""The plan scheduler as a pure state machine: which steps may start, retries, failure propagation.

Owns: DAG validation (unknown dependencies, cycles), dependency order, the concurrency limit, retry with
exponential backoff for retryable failures within the deadline, skipping the dependents of a failed step,
and skipping everything not started once the deadline passes. Fed events (``started``, ``succeeded``,
``failed``) and a clock value; returns decisions (steps to start, when to wake up). No I/O, no time reads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tensorcast.errors import InvalidArgument, clip

__all__ = ["PlanState", "StepState"]

PENDING, RUNNING, SUCCEEDED, FAILED, SKIPPED = "pending", "running", "succeeded", "failed", "skipped"


@dataclass
class StepState:
    id: str
    deps: tuple[str, ...]
    status: str = PENDING
    attempts: int = 0
    retry_at: float = 0.0
    reason: str = ""


@dataclass
class PlanState:
    deps: Mapping[str, Sequence[str]]
    concurrency: int
    max_attempts: int = 5
    backoff: float = 0.05
    max_backoff: float = 2.0
    steps: dict[str, StepState] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)  # a topological order

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise InvalidArgument(f"concurrency must be >= 1, got {self.concurrency}")
        for sid, ds in self.deps.items():
            for d in ds:
                if d not in self.deps:
                    raise InvalidArgument(f"step {clip(sid)} depends on unknown step {clip(d)}")
                if d == sid:
                    raise InvalidArgument(f"step {clip(sid)} depends on itself")
            self.steps[sid] = StepState(sid, tuple(dict.fromkeys(ds)))
        self.order = self._toposort()

    def _toposort(self) -> list[str]:
        indegree = {s: len(st.deps) for s, st in self.steps.items()}
        dependents: dict[str, list[str]] = {s: [] for s in self.steps}
        for s, st in self.steps.items():
            for d in st.deps:
                dependents[d].append(s)
        ready = [s for s, n in indegree.items() if n == 0]
        out: list[str] = []
        while ready:
            s = ready.pop(0)
            out.append(s)
            for t in dependents[s]:
                indegree[t] -= 1
                if indegree[t] == 0:
                    ready.append(t)
        if len(out) != len(self.steps):
            cyclic = sorted(s for s, n in indegree.items() if n > 0)
            raise InvalidArgument(f"plan has a dependency cycle among steps {cyclic}")
        return out

    # ----------------------------------------------------------------- queries
    @property
    def running(self) -> int:
        return sum(1 for s in self.steps.values() if s.status == RUNNING)

    @property
    def finished(self) -> bool:
        return all(s.status in (SUCCEEDED, FAILED, SKIPPED) for s in self.steps.values())

    @property
    def succeeded_all(self) -> bool:
        return all(s.status == SUCCEEDED for s in self.steps.values())

    def next_wakeup(self) -> float | None:
        waits = [s.retry_at for s in self.steps.values() if s.status == PENDING and s.attempts > 0]
        return min(waits) if waits else None

    # ----------------------------------------------------------------- decisions
    def start_ready(self, now: float) -> list[str]:
        """Steps to start now (dependency order, concurrency limit); they become running."""
        out: list[str] = []
        free = self.concurrency - self.running
        for sid in self.order:
            if free <= 0:
                break
            st = self.steps[sid]
            if st.status != PENDING or st.retry_at > now:
                continue
            if all(self.steps[d].status == SUCCEEDED for d in st.deps):
                st.status = RUNNING
                st.attempts += 1
                out.append(sid)
                free -= 1
        return out

    def mark_succeeded(self, sid: str) -> None:
        self.steps[sid].status = SUCCEEDED

    def mark_failed(self, sid: str, retryable: bool, now: float, deadline: float | None, reason: str) -> bool:
        """Record a failure; True if the step will be retried (after its backoff)."""
        st = self.steps[sid]
        delay = min(self.backoff * (2 ** (st.attempts - 1)), self.max_backoff)
        if retryable and st.attempts < self.max_attempts and (deadline is None or now + delay < deadline):
            st.status = PENDING
            st.retry_at = now + delay
            st.reason = reason
            return True
        st.status = FAILED
        st.reason = reason
        self._skip_dependents(sid)
        return False

    def _skip_dependents(self, failed: str) -> None:
        for sid in self.order:
            st = self.steps[sid]
            if st.status == PENDING and any(self.steps[d].status in (FAILED, SKIPPED) for d in st.deps):
                st.status = SKIPPED
                st.reason = f"a dependency failed ({failed})"

    def expire(self, reason: str = "deadline exceeded") -> None:
        """The deadline passed: nothing that has not started will start."""
        for st in self.steps.values():
            if st.status == PENDING:
                st.status = SKIPPED
                st.reason = reason
