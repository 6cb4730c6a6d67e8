"""Running a tensor-parallel group's weight swap from a caller: a one-step plan on a gateway.

Owns: ``group_swap(client, instances, model, version)`` — resolving the newest version when none is given
(once, so that every rank gets the same number), building the plan (``Plan.group_swap``), running it, and
raising the step's typed error (``SwapAborted``: every rank kept its version; ``VersionConflict``;
``Unavailable`` for a committed swap a rank could not activate) or returning ``GroupSwapResult``. Does not
own: the protocol (``plans.group_swap``, ``weights.group``) or what a rank does (``client.binding``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tensorcast.client.publisher import list_versions
from tensorcast.context import CallContext
from tensorcast.errors import NotFound, error_from_code
from tensorcast.plans.builder import Plan, PlanOutcome
from tensorcast.wire.caller import Caller
from tensorcast.wire.messages import RunPlan

__all__ = ["GroupSwapResult", "group_swap"]


@dataclass(frozen=True)
class GroupSwapResult:
    """A group swap that activated on every rank."""

    model: str
    version: int
    swap_id: str
    seconds: float
    ranks: dict[str, dict[str, Any]] = field(default_factory=dict)  # instance -> phase and its swap report
    fetch: str = ""  # how the ranks fetched: "view" or "whole" (see ``Plan.group_swap``)


class PlanPort(Protocol):
    caller: Caller

    async def run_plan(self, spec: RunPlan, ctx: CallContext | None = None) -> PlanOutcome: ...


async def group_swap(client: PlanPort, instances: Sequence[str], model: str, version: int | None = None, *,
                     expected: int | None = None, timeout: float | None = None,
                     fetch: str | None = None) -> GroupSwapResult:
    """Run a one-step plan swapping ``instances`` (binding ranks) to ``version`` (default: the newest)."""
    t0 = time.perf_counter()
    ctx = client.caller.context(timeout)
    if version is None:
        version = max(await list_versions(client.caller, model, ctx), default=None)
        if version is None:
            raise NotFound(f"no version of {model} is published")
    plan = Plan(ctx, client.run_plan)
    step = plan.group_swap(instances, model, version, expected=expected, fetch=fetch)
    outcome: PlanOutcome = await plan.run(concurrency=1)
    result = outcome[step]
    if not outcome.ok:
        raise error_from_code(result.error_code or "INTERNAL", result.error or result.status, ctx.trace_id)
    return GroupSwapResult(model=model, version=version, swap_id=str(result.result.get("swap_id", "")),
                           seconds=time.perf_counter() - t0, ranks=dict(result.result.get("ranks", {})),
                           fetch=str(result.result.get("fetch", "")))
