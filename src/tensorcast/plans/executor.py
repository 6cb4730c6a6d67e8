"""Running a plan on a gateway: validation, dispatch, retries, deadline, idempotent re-runs.

Owns: turning a ``RunPlan`` into a ``PlanState`` (refusing bad plans — unknown operations, missing or
unknown arguments, references to unknown steps, cycles, unknown workers or instances — with
``InvalidArgument`` before any step starts), running ready steps concurrently up to the limit,
resolving ``{"$ref": step}`` arguments to earlier outputs, retrying retryable failures with backoff while
the deadline allows, not starting anything once it has passed, and the record of finished steps per
idempotency key so that a re-run never redoes them. No rollback: a failed plan leaves whatever its
finished steps made (replicas, published pages), reused or collected by their normal rules.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from tensorcast.context import CallContext
from tensorcast.errors import InternalError, InvalidArgument, TensorCastError, clip
from tensorcast.obs import metrics, tracing
from tensorcast.plans.ops import OPS, GatewayPort
from tensorcast.plans.state import FAILED, SKIPPED, SUCCEEDED, PlanState
from tensorcast.records import StepResult, StepSpec
from tensorcast.wire.messages import PlanResult, RunPlan

__all__ = ["PlanExecutor"]

log = logging.getLogger("tensorcast.plans")


@dataclass
class _Record:
    """What one idempotency key has produced so far."""

    results: dict[str, StepResult] = field(default_factory=dict)
    running: asyncio.Future[PlanResult] | None = None
    touched: float = 0.0


class PlanExecutor:
    def __init__(self, gateway: GatewayPort, *, max_records: int = 10_000, max_attempts: int = 5) -> None:
        self.gateway = gateway
        self.max_records = max_records
        self.max_attempts = max_attempts
        self._records: OrderedDict[str, _Record] = OrderedDict()
        self.in_flight = 0  # plans running now (a dashboard and heartbeat signal)

    async def run(self, msg: RunPlan, ctx: CallContext) -> PlanResult:
        steps = {s.id: s for s in msg.steps}
        if len(steps) != len(msg.steps):
            raise InvalidArgument("plan step ids must be unique")
        if not steps:
            raise InvalidArgument("a plan needs at least one step")
        deps = {sid: tuple(dict.fromkeys((*s.after, *_refs(s.args)))) for sid, s in steps.items()}
        state = PlanState(deps, msg.concurrency, max_attempts=self.max_attempts)  # cycles, unknown deps
        for s in msg.steps:
            await self._validate(s, ctx)

        key = msg.idempotency_key
        record = self._record(key) if key else _Record()
        if record.running is not None and not record.running.done():
            log.info("plan %s already running: waiting for it", key)
            await asyncio.shield(record.running)
        reused = tuple(sid for sid, r in record.results.items() if r.status == SUCCEEDED and sid in steps)
        for sid in reused:
            state.mark_succeeded(sid)
        fut: asyncio.Future[PlanResult] = asyncio.get_running_loop().create_future()
        record.running = fut
        self.in_flight += 1
        try:
            with tracing.span("plan", ctx.trace_id, attributes={"steps": len(steps), "reused": len(reused)}):
                result = await self._execute(steps, state, record, ctx, reused)
            fut.set_result(result)
            return result
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: nobody else may be waiting
            raise
        finally:
            self.in_flight -= 1

    def _record(self, key: str) -> _Record:
        rec = self._records.get(key)
        if rec is None:
            rec = self._records[key] = _Record()
            while len(self._records) > self.max_records:
                self._records.popitem(last=False)
        self._records.move_to_end(key)
        rec.touched = time.time()
        return rec

    async def _validate(self, step: StepSpec, ctx: CallContext) -> None:
        op = OPS.get(step.op)
        if op is None:
            raise InvalidArgument(f"step {clip(step.id)}: unknown operation {clip(step.op)}; known: {sorted(OPS)}")
        missing = [a for a in op.required if a not in step.args]
        unknown = [a for a in step.args if a not in op.required and a not in op.optional]
        if missing or unknown:
            raise InvalidArgument(f"step {clip(step.id)} ({step.op}): missing arguments {missing}, unknown {unknown}")
        try:
            await op.validate(step.args, self.gateway, ctx)
        except InvalidArgument as exc:
            raise InvalidArgument(f"step {clip(step.id)} ({step.op}): {exc.message}") from None

    async def _execute(self, steps: dict[str, StepSpec], state: PlanState, record: _Record, ctx: CallContext,
                       reused: tuple[str, ...]) -> PlanResult:
        plan_id = uuid.uuid4().hex[:12]
        results = record.results
        running: dict[asyncio.Task[Any], str] = {}
        started: dict[str, float] = {}
        while not state.finished:
            now = time.time()
            if ctx.deadline is not None and now >= ctx.deadline:
                state.expire()
            for sid in state.start_ready(now):
                started[sid] = time.time()
                task = asyncio.ensure_future(self._run_step(steps[sid], results, ctx))
                running[task] = sid
            if not running:
                wake = state.next_wakeup()
                if wake is None:
                    break
                await asyncio.sleep(max(0.0, min(wake, ctx.deadline or wake) - time.time()))
                continue
            wake = state.next_wakeup()
            timeout = None if wake is None else max(0.0, wake - time.time())
            if ctx.deadline is not None:
                timeout = max(0.0, min(timeout if timeout is not None else ctx.deadline, ctx.deadline - time.time()))
            done, _ = await asyncio.wait(running, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                sid = running.pop(task)
                spec = steps[sid]
                exc = task.exception()
                if exc is None:
                    output, extra = task.result()
                    state.mark_succeeded(sid)
                    results[sid] = StepResult(id=sid, op=spec.op, status=SUCCEEDED, output=output, result=extra,
                                              attempts=state.steps[sid].attempts, started=started[sid],
                                              finished=time.time())
                    continue
                err = exc if isinstance(exc, TensorCastError) else InternalError(f"{type(exc).__name__}: {exc}")
                retry = state.mark_failed(sid, err.retryable, time.time(), ctx.deadline, err.message)
                log.log(logging.INFO if retry else logging.WARNING, "plan step %s (%s) failed%s: %s", sid, spec.op,
                        ", retrying" if retry else "", err)
                if not retry:
                    results[sid] = StepResult(id=sid, op=spec.op, status=FAILED, error_code=err.code,
                                              error=err.message, retryable=err.retryable,
                                              attempts=state.steps[sid].attempts, started=started[sid],
                                              finished=time.time())
        for sid, st in state.steps.items():
            if st.status == SKIPPED:
                results[sid] = StepResult(id=sid, op=steps[sid].op, status=SKIPPED, error=st.reason,
                                          attempts=st.attempts)
        status = SUCCEEDED if state.succeeded_all else FAILED
        log.info("plan %s finished: %s (%d steps, %d reused)", plan_id, status, len(steps), len(reused))
        return PlanResult(plan_id=plan_id, status=status, steps=tuple(results[s] for s in state.order),
                          reused=reused)

    async def _run_step(self, spec: StepSpec, results: dict[str, StepResult],
                        ctx: CallContext) -> tuple[tuple[str, ...], dict[str, Any]]:
        ctx.check(f"step {spec.id}")
        args = _resolve(spec.args, results)
        started = time.perf_counter()
        status = "succeeded"
        try:
            with tracing.span(f"step {spec.op}", ctx.trace_id, attributes={"step": spec.id, "op": spec.op}):
                outcome = await OPS[spec.op].run(args, self.gateway, ctx)
        except BaseException as exc:
            status = "retryable_error" if isinstance(exc, TensorCastError) and exc.retryable else "failed"
            raise
        finally:
            metrics.plan_step(spec.op, status, time.perf_counter() - started)
        return outcome.output, outcome.result or {}


def _refs(value: Any) -> list[str]:
    if isinstance(value, dict):
        if set(value) == {"$ref"}:
            return [str(value["$ref"])]
        return [r for v in value.values() for r in _refs(v)]
    if isinstance(value, list | tuple):
        return [r for v in value for r in _refs(v)]
    return []


def _resolve(value: Any, results: dict[str, StepResult]) -> Any:
    if isinstance(value, dict):
        if set(value) == {"$ref"}:
            return list(results[value["$ref"]].output)
        return {k: _resolve(v, results) for k, v in value.items()}
    if isinstance(value, list | tuple):
        out: list[Any] = []
        for v in value:
            r = _resolve(v, results)
            # A reference inside a list splices the referenced outputs in.
            out.extend(r) if isinstance(v, dict) and set(v) == {"$ref"} else out.append(r)
        return out
    return value
