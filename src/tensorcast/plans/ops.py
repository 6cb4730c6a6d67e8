"""The operations a plan step may run, as a registry: adding an operation is one ``StepOp`` entry.

Owns: each operation's argument validation (run before any step starts, so a bad plan is refused with
``InvalidArgument`` and nothing happens) and its execution through the gateway's ports (route a message
to a worker, call the global store, call an instance). Every operation is idempotent by construction:
prefetch to a holder is a no-op, publish of the same KV bytes yields the same artifact, delete of a
missing artifact succeeds. Outputs are tuples of artifact ids that later steps may consume.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tensorcast.context import CallContext
from tensorcast.errors import InvalidArgument, NotFound, clip
from tensorcast.plans.group_swap import run_group_swap, validate_group_swap
from tensorcast.tensors import ARTIFACT_ID_RE
from tensorcast.wire.messages import (
    DeleteArtifact,
    Evict,
    InstanceCall,
    InstanceReply,
    Prefetch,
    ReleaseLease,
    Unpin,
)

__all__ = ["OPS", "GatewayPort", "StepOp", "StepOutcome"]


class GatewayPort(Protocol):
    """What plan operations may do on the gateway that runs them."""

    async def route(self, worker_id: str, msg: Any, ctx: CallContext) -> Any: ...

    async def gs_call(self, msg: Any, ctx: CallContext) -> Any: ...

    async def instance_call(self, instance_id: str, msg: InstanceCall, ctx: CallContext) -> InstanceReply: ...

    async def worker_ids(self, ctx: CallContext) -> set[str]: ...

    async def instance_ids(self, ctx: CallContext) -> set[str]: ...


@dataclass(frozen=True)
class StepOutcome:
    output: tuple[str, ...] = ()
    result: dict[str, Any] | None = None


Validator = Callable[[dict[str, Any], GatewayPort, CallContext], Awaitable[None]]
Runner = Callable[[dict[str, Any], GatewayPort, CallContext], Awaitable[StepOutcome]]


@dataclass(frozen=True)
class StepOp:
    name: str
    required: tuple[str, ...]
    optional: tuple[str, ...]
    validate: Validator
    run: Runner


# ----------------------------------------------------------------- argument checks


def _artifacts(args: dict[str, Any], key: str = "artifacts") -> tuple[str, ...]:
    value = args[key]
    ids = (value,) if isinstance(value, str) else tuple(value)
    for a in ids:
        if not isinstance(a, str) or not ARTIFACT_ID_RE.match(a):
            raise InvalidArgument(f"{key}: {clip(a)} is not an artifact id")
    return ids


def _is_ref(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"$ref"}


async def _check_worker(args: dict[str, Any], gw: GatewayPort, ctx: CallContext, key: str) -> None:
    wid = args[key]
    if not isinstance(wid, str) or wid not in await gw.worker_ids(ctx):
        raise InvalidArgument(f"{key}: unknown worker {clip(wid)}")


async def _check_instance(args: dict[str, Any], gw: GatewayPort, ctx: CallContext) -> None:
    iid = args["instance"]
    if not isinstance(iid, str) or iid not in await gw.instance_ids(ctx):
        raise InvalidArgument(f"instance: unknown instance {clip(iid)}")


def _check_artifacts_arg(args: dict[str, Any]) -> None:
    """Artifact ids, step references, or a list mixing both."""
    value = args["artifacts"]
    items = value if isinstance(value, list | tuple) else [value]
    for item in items:
        if not _is_ref(item):
            _artifacts({"artifacts": item})


# ----------------------------------------------------------------- worker operations


def _per_worker(msg_type: type, key: str, fixed: dict[str, Any] | None = None) -> tuple[Validator, Runner]:
    async def validate(args: dict[str, Any], gw: GatewayPort, ctx: CallContext) -> None:
        _check_artifacts_arg(args)
        await _check_worker(args, gw, ctx, key)

    async def run(args: dict[str, Any], gw: GatewayPort, ctx: CallContext) -> StepOutcome:
        ids = _artifacts(args)
        extra: dict[str, Any] = {k: args[k] for k in ("pin", "pin_ttl", "streams")
                                 if k in args and msg_type is Prefetch}
        extra.update(fixed or {})
        moved = 0
        for aid in ids:
            reply = await gw.route(args[key], msg_type(artifact_id=aid, worker_id=args[key], **extra), ctx)
            moved += getattr(reply, "bytes_moved", 0)
        return StepOutcome(ids, {"bytes_moved": moved} if msg_type is Prefetch else None)

    return validate, run


def _per_artifact(msg_factory: Callable[[str], Any]) -> tuple[Validator, Runner]:
    async def validate(args: dict[str, Any], gw: GatewayPort, ctx: CallContext) -> None:
        _check_artifacts_arg(args)

    async def run(args: dict[str, Any], gw: GatewayPort, ctx: CallContext) -> StepOutcome:
        for aid in _artifacts(args):
            with contextlib.suppress(NotFound):  # already gone: deleting twice is deleting once
                await gw.gs_call(msg_factory(aid), ctx)
        return StepOutcome(())

    return validate, run


# ----------------------------------------------------------------- instance operations


def _instance_op(op: str, needs_request: bool, takes_artifacts: bool) -> tuple[Validator, Runner]:
    async def validate(args: dict[str, Any], gw: GatewayPort, ctx: CallContext) -> None:
        await _check_instance(args, gw, ctx)
        if needs_request and (not isinstance(args.get("request_id"), str) or not args["request_id"]):
            raise InvalidArgument(f"{op}: request_id must be a non-empty string")
        if takes_artifacts:
            _check_artifacts_arg(args)

    async def run(args: dict[str, Any], gw: GatewayPort, ctx: CallContext) -> StepOutcome:
        call = InstanceCall(instance_id=args["instance"], op=op, request_id=args.get("request_id", ""),
                            artifacts=_artifacts(args) if takes_artifacts else (),
                            args=dict(args.get("options") or {}))
        reply = await gw.instance_call(args["instance"], call, ctx)
        return StepOutcome(reply.artifacts, reply.result or None)

    return validate, run


async def _validate_wait(args: dict[str, Any], gw: GatewayPort, ctx: CallContext) -> None:
    s = args["seconds"]
    if not isinstance(s, int | float) or isinstance(s, bool) or not 0 <= s <= 3600:
        raise InvalidArgument(f"wait: seconds must be a number in [0, 3600], got {clip(s)}")


async def _run_wait(args: dict[str, Any], gw: GatewayPort, ctx: CallContext) -> StepOutcome:
    await asyncio.sleep(float(args["seconds"]))
    return StepOutcome(_artifacts(args) if args.get("artifacts") else ())


async def _run_group_swap(args: dict[str, Any], gw: GatewayPort, ctx: CallContext) -> StepOutcome:
    return StepOutcome((), await run_group_swap(args, gw, ctx))


def _op(name: str, required: tuple[str, ...], optional: tuple[str, ...], pair: tuple[Validator, Runner]) -> StepOp:
    return StepOp(name, required, optional, pair[0], pair[1])


OPS: dict[str, StepOp] = {
    op.name: op
    for op in (
        _op("prefetch", ("artifacts", "to"), ("pin", "pin_ttl", "streams"), _per_worker(Prefetch, "to")),
        _op("pin", ("artifacts", "on"), ("pin_ttl",), _per_worker(Prefetch, "on", {"pin": True})),
        _op("unpin", ("artifacts", "on"), (), _per_worker(Unpin, "on")),
        _op("evict", ("artifacts", "on"), (), _per_worker(Evict, "on")),
        _op("delete", ("artifacts",), (), _per_artifact(lambda aid: DeleteArtifact(key_or_id=aid))),
        _op("release", ("artifacts",), (), _per_artifact(lambda aid: ReleaseLease(artifact_id=aid))),
        _op("publish", ("instance", "request_id"), ("options",), _instance_op("publish", True, False)),
        _op("hydrate", ("instance", "request_id", "artifacts"), ("options",), _instance_op("hydrate", True, True)),
        _op("transform_into", ("instance", "artifacts"), ("options",), _instance_op("transform_into", False, True)),
        StepOp("wait", ("seconds",), ("artifacts",), _validate_wait, _run_wait),
        StepOp("group_swap", ("instances", "model", "version", "swap_id"),
               ("expected", "reserve", "max_attempts", "fetch"), validate_group_swap, _run_group_swap),
    )
}
