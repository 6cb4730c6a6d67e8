"""Building a plan on the caller's side (no I/O): steps, their outputs, and dependencies.

Owns: ``Plan`` (one method per registered operation, each returning a ``PlanStep``), ``PlanStep.output``
(a reference a later step may consume, which adds the dependency), ``after=[...]`` for explicit
dependencies, and turning it all into a ``RunPlan`` message. Running is the client's job
(``Plan.run`` returns an ``Operation``); validation happens on the gateway before anything runs.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tensorcast.context import CallContext
from tensorcast.errors import InvalidArgument
from tensorcast.records import StepResult, StepSpec
from tensorcast.wire.messages import PlanResult, RunPlan

__all__ = ["Plan", "PlanOutcome", "PlanStep", "StepOutput"]


@dataclass(frozen=True)
class StepOutput:
    """The artifact ids a step will produce; usable wherever a step takes artifacts."""

    step_id: str

    def ref(self) -> dict[str, str]:
        return {"$ref": self.step_id}


@dataclass
class PlanStep:
    id: str
    op: str
    args: dict[str, Any]
    after: tuple[str, ...] = ()

    @property
    def output(self) -> StepOutput:
        return StepOutput(self.id)


@dataclass
class Plan:
    """A DAG of operations with one shared CallContext; submit it with ``run(concurrency=k)``."""

    ctx: CallContext
    _submit: Callable[[RunPlan, CallContext], Any]
    steps: list[PlanStep] = field(default_factory=list)

    def _artifacts(self, value: Any) -> Any:
        if isinstance(value, StepOutput):
            return value.ref()
        if isinstance(value, PlanStep):
            return value.output.ref()
        if isinstance(value, str):
            return value
        if hasattr(value, "id") and isinstance(value.id, str):  # an Artifact
            return value.id
        if isinstance(value, Sequence):
            return [self._artifacts(v) for v in value]
        raise InvalidArgument(f"expected artifact ids, artifacts or a step output, got {type(value).__name__}")

    def _add(self, op: str, args: dict[str, Any], after: Sequence[PlanStep | str] | None) -> PlanStep:
        deps = tuple(a.id if isinstance(a, PlanStep) else str(a) for a in (after or ()))
        step = PlanStep(id=f"{op}-{len(self.steps) + 1}", op=op, args={k: v for k, v in args.items() if v is not None},
                        after=deps)
        self.steps.append(step)
        return step

    # ------------------------------------------------------------- worker operations
    def prefetch(self, artifacts: Any, to: str, *, pin: bool = False, streams: int = 0,
                 after: Sequence[PlanStep | str] | None = None) -> PlanStep:
        return self._add("prefetch", {"artifacts": self._artifacts(artifacts), "to": to, "pin": pin or None,
                                      "streams": streams or None}, after)

    def pin(self, artifacts: Any, on: str, *, ttl: float | None = None,
            after: Sequence[PlanStep | str] | None = None) -> PlanStep:
        return self._add("pin", {"artifacts": self._artifacts(artifacts), "on": on, "pin_ttl": ttl}, after)

    def unpin(self, artifacts: Any, on: str, *, after: Sequence[PlanStep | str] | None = None) -> PlanStep:
        return self._add("unpin", {"artifacts": self._artifacts(artifacts), "on": on}, after)

    def evict(self, artifacts: Any, on: str, *, after: Sequence[PlanStep | str] | None = None) -> PlanStep:
        return self._add("evict", {"artifacts": self._artifacts(artifacts), "on": on}, after)

    def delete(self, artifacts: Any, *, after: Sequence[PlanStep | str] | None = None) -> PlanStep:
        return self._add("delete", {"artifacts": self._artifacts(artifacts)}, after)

    def release(self, artifacts: Any, *, after: Sequence[PlanStep | str] | None = None) -> PlanStep:
        return self._add("release", {"artifacts": self._artifacts(artifacts)}, after)

    def wait(self, seconds: float, artifacts: Any = None, *, after: Sequence[PlanStep | str] | None = None) -> PlanStep:
        """Pause (pacing, tests); passes ``artifacts`` through as its output."""
        arts = None if artifacts is None else self._artifacts(artifacts)
        return self._add("wait", {"seconds": seconds, "artifacts": arts}, after)

    # ------------------------------------------------------------- instance operations
    def publish(self, instance: str, request_id: str, *, options: dict[str, Any] | None = None,
                after: Sequence[PlanStep | str] | None = None) -> PlanStep:
        """Export a request's KV cache from ``instance`` as artifacts (the step's output)."""
        return self._add("publish", {"instance": instance, "request_id": request_id, "options": options}, after)

    def hydrate(self, instance: str, request_id: str, artifacts: Any, *, options: dict[str, Any] | None = None,
                after: Sequence[PlanStep | str] | None = None) -> PlanStep:
        """Load published KV artifacts into ``instance`` for ``request_id``."""
        return self._add("hydrate", {"instance": instance, "request_id": request_id,
                                     "artifacts": self._artifacts(artifacts), "options": options}, after)

    def transform_into(self, instance: str, artifacts: Any, *, options: dict[str, Any] | None = None,
                       after: Sequence[PlanStep | str] | None = None) -> PlanStep:
        """Fill ``instance``'s parameters in place from weight artifacts."""
        return self._add("transform_into", {"instance": instance, "artifacts": self._artifacts(artifacts),
                                            "options": options}, after)

    def group_swap(self, instances: Sequence[str], model: str, version: int, *, expected: int | None = None,
                   swap_id: str | None = None, reserve: float | None = None, max_attempts: int | None = None,
                   fetch: str | None = None, after: Sequence[PlanStep | str] | None = None) -> PlanStep:
        """Swap the binding ranks served as ``instances`` (one tensor-parallel engine) to ``version`` of
        ``model`` together: all prepare, then all activate; if any fails to prepare or the deadline passes
        first, all keep their version (``SwapAborted``). ``expected``: the version every rank must have active
        (0: none). ``reserve``: seconds kept for activating after the commit point. ``fetch``: ``"view"``
        (each rank's slices come to its host) or ``"whole"`` (each host's worker pulls the whole version
        once); None: whole when every rank stages through one worker. See docs/weight-sync.md."""
        return self._add("group_swap", {"instances": list(instances), "model": model, "version": version,
                                        "expected": expected, "swap_id": swap_id or uuid.uuid4().hex,
                                        "reserve": reserve, "max_attempts": max_attempts, "fetch": fetch}, after)

    # ------------------------------------------------------------- submission
    def spec(self, concurrency: int = 4) -> RunPlan:
        return RunPlan(steps=tuple(StepSpec(id=s.id, op=s.op, args=s.args, after=s.after) for s in self.steps),
                       concurrency=concurrency, idempotency_key=self.ctx.idempotency_key)

    def run(self, concurrency: int = 4) -> Any:
        """Submit to the gateway; returns an ``Operation`` (sync client) or a coroutine (asyncio client)
        whose result is a ``PlanOutcome``."""
        return self._submit(self.spec(concurrency), self.ctx)


@dataclass(frozen=True)
class PlanOutcome:
    """Per-step status and output of a finished plan."""

    raw: PlanResult

    @property
    def ok(self) -> bool:
        return self.raw.status == "succeeded"

    @property
    def status(self) -> str:
        return self.raw.status

    @property
    def steps(self) -> tuple[StepResult, ...]:
        return self.raw.steps

    @property
    def reused(self) -> tuple[str, ...]:
        return self.raw.reused

    def __getitem__(self, step: PlanStep | str) -> StepResult:
        sid = step.id if isinstance(step, PlanStep) else step
        for s in self.raw.steps:
            if s.id == sid:
                return s
        raise KeyError(sid)

    def output(self, step: PlanStep | str) -> tuple[str, ...]:
        return self[step].output
