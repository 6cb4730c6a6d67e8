"""The ``group_swap`` plan operation: a tensor-parallel group's ranks swap weights together, or not at all.

Owns: validating the step's arguments and running the two-phase protocol of ``weights.group.GroupSwap`` on a
gateway: every rank (an instance serving a binding, ``instance.binding``) is sent engine commands
``weights.prepare`` / ``weights.activate`` / ``weights.abort`` through the gateway's instance calls,
concurrently, with the step's deadline. Prepares are told how to fetch (``fetch``: asked by the step, else
``weights.group.fetch_mode`` on the workers the ranks stage through, from ``weights.status``: ``whole`` when
they share one). Prepares get until the commit point (``deadline - reserve``); activations get the rest.
Aborted: ``SwapAborted`` (every rank kept its old version). Committed but a rank could not be activated:
``Unavailable`` (retryable: the plan runs the same swap again, which completes it; ranks already on the
version are no-ops). Does not own: the decisions (``weights.group``), what a rank does (``client.binding``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol

from tensorcast.context import CallContext
from tensorcast.errors import InternalError, InvalidArgument, SwapAborted, TensorCastError, Unavailable, clip
from tensorcast.weights.group import FETCH_MODES, PREPARE, GroupSwap, fetch_mode
from tensorcast.wire.messages import InstanceCall, InstanceReply

__all__ = ["DEFAULT_RESERVE", "InstancePort", "run_group_swap", "validate_group_swap"]

# Seconds kept for activations after the commit point, when the step does not say (capped at a quarter of
# the time the plan has left when the step starts).
DEFAULT_RESERVE = 5.0


class InstancePort(Protocol):
    """What the operation needs of the gateway (a part of ``plans.ops.GatewayPort``)."""

    async def instance_call(self, instance_id: str, msg: InstanceCall, ctx: CallContext) -> InstanceReply: ...

    async def instance_ids(self, ctx: CallContext) -> set[str]: ...


def _number(args: dict[str, Any], key: str, low: float) -> None:
    v = args.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or not low <= v <= 3600):
        raise InvalidArgument(f"group_swap: {key} must be a number in [{low:g}, 3600], got {clip(v)}")


async def validate_group_swap(args: dict[str, Any], gw: InstancePort, ctx: CallContext) -> None:
    ranks = args["instances"]
    if not isinstance(ranks, list | tuple) or not ranks or not all(isinstance(r, str) and r for r in ranks) \
            or len(set(ranks)) != len(ranks):
        raise InvalidArgument(f"group_swap: instances must be distinct instance ids, got {clip(ranks)}")
    unknown = sorted(set(ranks) - await gw.instance_ids(ctx))
    if unknown:
        raise InvalidArgument(f"group_swap: unknown instances {unknown[:5]}")
    if not isinstance(args["model"], str) or not args["model"]:
        raise InvalidArgument(f"group_swap: model must be a non-empty string, got {clip(args['model'])}")
    for key, low in (("version", 1), ("expected", 0)):
        v = args.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
            raise InvalidArgument(f"group_swap: {key} must be an integer >= {low}, got {clip(v)}")
    if not isinstance(args["swap_id"], str) or not args["swap_id"]:
        raise InvalidArgument("group_swap: swap_id must be a non-empty string")
    _number(args, "reserve", 0)
    _number(args, "max_attempts", 1)
    if args.get("fetch") is not None and args["fetch"] not in FETCH_MODES:
        raise InvalidArgument(f"group_swap: fetch must be one of {FETCH_MODES} (or none: decided), got "
                              f"{clip(args['fetch'])}")


def _machine(args: dict[str, Any], ctx: CallContext) -> GroupSwap:
    reserve = args.get("reserve")
    if reserve is None:
        left = ctx.remaining()
        reserve = DEFAULT_RESERVE if left is None else min(DEFAULT_RESERVE, max(0.0, left) / 4)
    return GroupSwap(tuple(args["instances"]), ctx.deadline, reserve=float(reserve),
                     max_attempts=int(args.get("max_attempts") or 3))


async def _send(gw: InstancePort, machine: GroupSwap, rank: str, action: str, args: dict[str, Any],
                ctx: CallContext) -> dict[str, Any]:
    command = {"command": f"weights.{action}", "model": args["model"], "swap_id": args["swap_id"],
               "expected": args.get("expected")}
    call_ctx = ctx
    if action == PREPARE:
        command["version"] = args["version"]
        command["fetch"] = args["fetch"]
        if machine.commit_by is not None:  # a prepare must end by the commit point, fetches included
            call_ctx = replace(ctx, deadline=machine.commit_by)
            command["timeout"] = max(0.0, machine.commit_by - time.time())
    msg = InstanceCall(instance_id=rank, op="engine", args=command)
    reply = await gw.instance_call(rank, msg, call_ctx)
    return dict(reply.result or {})


async def _vias(gw: InstancePort, ranks: Sequence[str], model: str, ctx: CallContext) -> dict[str, str]:
    """The worker each rank stages through (its binding's ``via``), from ``weights.status``; a rank that
    does not answer is left out (the decision is then ``view``, and its prepare reports the failure)."""
    async def via(rank: str) -> str:
        msg = InstanceCall(instance_id=rank, op="engine", args={"command": "weights.status", "model": model})
        return str((await gw.instance_call(rank, msg, ctx)).result.get("via") or "")

    answers = await asyncio.gather(*(via(r) for r in ranks), return_exceptions=True)
    return {r: a for r, a in zip(ranks, answers, strict=True) if isinstance(a, str) and a}


async def run_group_swap(args: dict[str, Any], gw: InstancePort, ctx: CallContext) -> dict[str, Any]:
    """Run the protocol to its end; returns the per-rank report of a fully activated swap."""
    machine = _machine(args, ctx)
    asked = args.get("fetch")  # the ranks' workers are asked only when the step leaves it to the decision
    vias = {} if asked else await _vias(gw, machine.ranks, args["model"], ctx)
    args = {**args, "fetch": fetch_mode(machine.ranks, vias, asked)}
    running: dict[asyncio.Task[dict[str, Any]], tuple[str, str]] = {}
    try:
        while not machine.finished:
            for rank, action in machine.actions(time.time()):
                running[asyncio.ensure_future(_send(gw, machine, rank, action, args, ctx))] = (rank, action)
            if not running:
                wake = machine.next_wakeup()
                if wake is None:
                    raise InternalError(f"group swap stalled: {machine.report()}")
                await asyncio.sleep(max(0.0, wake - time.time()))
                continue
            wake = machine.next_wakeup()
            timeout = None if wake is None else max(0.0, wake - time.time())
            done, _ = await asyncio.wait(running, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                rank, action = running.pop(task)
                exc = task.exception()
                if exc is None:
                    machine.done(rank, action, time.time(), task.result())
                    continue
                err = exc if isinstance(exc, TensorCastError) else InternalError(f"{type(exc).__name__}: {exc}")
                machine.failed(rank, action, err.retryable, f"{err.code}: {err.message}", time.time())
    finally:
        for task in running:
            task.cancel()
    return _outcome(machine, args)


def _outcome(machine: GroupSwap, args: dict[str, Any]) -> dict[str, Any]:
    report = machine.report()
    if machine.status == "aborted":
        dropped = [r for r, s in report.items() if s["phase"] == "abort_failed"]
        extra = f"; ranks {dropped} did not confirm the abort (their staging expires)" if dropped else ""
        raise SwapAborted(f"group swap of {args['model']} to version {args['version']} aborted, every rank kept "
                          f"its version: {machine.reason}{extra}")
    if machine.status == "partial":
        failed = {r: s["error"] for r, s in report.items() if s["phase"] != "active"}
        raise Unavailable(f"group swap of {args['model']} to version {args['version']} committed, but ranks "
                          f"{sorted(failed)} were not activated ({failed}); run the same swap again")
    return {"status": "activated", "version": args["version"], "swap_id": args["swap_id"], "fetch": args["fetch"],
            "ranks": report}

