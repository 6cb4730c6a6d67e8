"""Executing a rebalancer's ``Move``: one plan through the public client, then the session is rerouted.

Owns: ``MoveSession``, which turns a ``Move`` into one plan — ``publish`` the session's KV cache on the
source instance, ``prefetch`` the published artifacts to the target's home worker, ``hydrate`` them into the
target instance — runs it on a gateway, and, only if every step succeeded, rewrites the ``SessionTable`` so
the session's next turn goes to the target. A failed or half-finished plan leaves the session where it was
(publishing copies the cache, it does not take it away). This is the only part of ``tensorcast.policies``
that does I/O (the client call) and reads a clock (the plan's deadline); deciding stays in the pure modules.

Does not own: deciding moves (``policies.rebalancer``) or what the steps do (plans and instances, see
``docs/plans-and-instances.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tensorcast.context import CallContext, context
from tensorcast.errors import InvalidArgument
from tensorcast.plans.builder import Plan, PlanOutcome, PlanStep
from tensorcast.policies.rebalancer import Move
from tensorcast.policies.sessions import SessionTable
from tensorcast.records import InstanceInfo

__all__ = ["MovePlan", "MoveSession", "PlanClient", "build_move"]


class PlanClient(Protocol):
    """What a move needs of a client: a plan builder (``tensorcast.Client.plan`` is one)."""

    def plan(self, ctx: CallContext | None = None) -> Plan: ...


@dataclass(frozen=True)
class MovePlan:
    """The three steps one move adds to a plan."""

    publish: PlanStep
    prefetch: PlanStep
    hydrate: PlanStep


def build_move(plan: Plan, move: Move, target_worker: str) -> MovePlan:
    """Add ``move``'s steps to ``plan`` (no I/O): publish on the source, prefetch the output to the target's
    home worker, hydrate the target once the prefetch is done."""
    pub = plan.publish(instance=move.source, request_id=move.request_id)
    pre = plan.prefetch(pub.output, to=target_worker)
    hyd = plan.hydrate(instance=move.target, request_id=move.request_id, artifacts=pub.output, after=[pre])
    return MovePlan(pub, pre, hyd)


def move_key(move: Move) -> str:
    """The plan's idempotency key: the same decision re-run reuses finished steps; a later decision for the
    same session (another turn, another time) is a new plan."""
    return f"move/{move.session_id}/{move.request_id}/{move.source}->{move.target}@{move.decided_at!r}"


class MoveSession:
    """Run moves with ``client`` and reroute their sessions in ``table`` on success."""

    def __init__(self, client: PlanClient, table: SessionTable, *, timeout: float = 60.0,
                 concurrency: int = 4) -> None:
        self.client = client
        self.table = table
        self.timeout = timeout
        self.concurrency = concurrency

    def plan(self, move: Move, instances: Sequence[InstanceInfo]) -> tuple[Plan, MovePlan]:
        """The move's plan, built but not run. ``instances`` (from ``list_instances()``) name the target's
        home worker; ``InvalidArgument`` if the target is not among them."""
        homes = {i.instance_id: i.home_worker for i in instances}
        if move.target not in homes:
            raise InvalidArgument(f"move target {move.target!r} is not a known instance")
        plan = self.client.plan(context(timeout=self.timeout, idempotency_key=move_key(move)))
        return plan, build_move(plan, move, homes[move.target])

    def run(self, move: Move, instances: Sequence[InstanceInfo]) -> PlanOutcome:
        """Run the move's plan and wait for it; on success the session's next turn goes to the target."""
        plan, _ = self.plan(move, instances)
        outcome: PlanOutcome = plan.run(concurrency=self.concurrency).result()
        if outcome.ok:
            self.table.assign(move.session_id, move.target)
        return outcome
