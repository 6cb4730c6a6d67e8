"""Copies of an artifact on further workers: those a fresh put's placement wants before the put returns, and
those that restore artifacts after a worker's loss.

Owns: placing a fresh put's extra copies (``place``: onto ``pool.placement.replica_candidates``, several at once;
a target that fails, or stops heartbeating, is replaced by the next candidate, within the put's deadline; a put
that got fewer copies than wanted says so in its record, ``ArtifactInfo.copies`` < ``replicas_wanted``, and is
logged) and the repair loop (every ``worker.repair_interval``: ask the global store which artifacts this worker
holds have too few copies on live workers, apply ``pool.placement.plan_repairs``, and have each target pull a
copy, ``Prefetch``, worker to worker). The global store only answers the query (``gs.goals``): it holds no
bytes and calls no worker. Does not own: the copy itself (``worker.loading``, ``worker.fetch``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from tensorcast import clock
from tensorcast.context import CallContext
from tensorcast.errors import TensorCastError
from tensorcast.pool.placement import Repair, plan_repairs, replica_candidates
from tensorcast.records import ArtifactInfo
from tensorcast.wire.messages import Prefetch
from tensorcast.worker.roles import WorkerParts

__all__ = ["Replicator"]

log = logging.getLogger("tensorcast.worker")
# While copies are being made, how often the targets' liveness is looked at again: a target that stopped
# heartbeating (paused, or its host gone) is given up on then, not at the deadline.
_LIVENESS_POLL = 1.0
# The part of a put's remaining time kept for its answer after the copies (at most this many seconds).
_ANSWER_MARGIN = 1.0
# Artifacts asked about per repair pass.
_BATCH = 100


class Replicator:
    def __init__(self, parts: WorkerParts) -> None:
        self.parts = parts
        self.busy: set[str] = set()  # artifacts this worker is making copies of right now
        self._avoid: dict[tuple[str, str], float] = {}  # (artifact, target) -> until when not to try it again
        self._tasks: set[asyncio.Task[None]] = set()

    # ----------------------------------------------------------------- a fresh put
    async def place(self, info: ArtifactInfo, wanted: int, ctx: CallContext) -> ArtifactInfo:
        """Make ``info`` (just committed here) held by ``wanted`` distinct live workers; returns its record.
        Fewer when fewer live workers take it within the put's deadline (a warning is logged)."""
        p = self.parts
        holders = {r.worker_id: r.host_id for r in info.replicas if r.alive} or {p.worker_id: p.host_id}
        need = wanted - len(holders)
        if need <= 0:
            return info
        left = ctx.remaining()
        stop = clock.time() + (600.0 if left is None else left - min(_ANSWER_MARGIN, 0.1 * max(left, 0.0)))
        mine = info.id not in self.busy  # (a repair of it may be running: it keeps its mark)
        self.busy.add(info.id)
        try:
            workers = await p.gs.list_workers(ctx)
            _done, failed = await self._copy(info.id, replica_candidates(workers, holders), need, stop)
        finally:
            if mine:
                self.busy.discard(info.id)
        out = await p.gs.get_artifact(info.id, ctx)
        if out.copies < wanted:
            log.warning("artifact %s has %d of the %d copies its placement wants on live workers (failed: %s); "
                        "more are made once workers can take them", info.id, out.copies, wanted,
                        ", ".join(failed) or "no other live worker")
        return out

    async def _copy(self, artifact_id: str, candidates: list[str], need: int,
                    stop: float) -> tuple[list[str], list[str]]:
        """Have up to ``need`` of ``candidates`` (best first) pull a copy, ``need`` at a time, the next one taking
        the place of one that fails or stops heartbeating; until ``stop``. Returns (done, failed)."""
        queue = list(candidates)
        pending: dict[asyncio.Future[None], str] = {}
        done: list[str] = []
        failed: list[str] = []
        try:
            while len(done) < need:
                while queue and len(pending) + len(done) < need:
                    target = queue.pop(0)
                    pending[asyncio.ensure_future(self._pull(artifact_id, target, stop))] = target
                left = stop - clock.time()
                if not pending or left <= 0:
                    break
                finished, _ = await asyncio.wait(pending, timeout=min(_LIVENESS_POLL, left),
                                                 return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    target = pending.pop(task)
                    (failed if task.exception() is not None else done).append(target)
                alive = await self._alive() if not finished else None
                for task, target in list(pending.items()):
                    if alive is not None and target not in alive:  # stopped heartbeating: the next one instead
                        task.cancel()
                        failed.append(pending.pop(task))
        finally:
            for task, target in pending.items():
                task.cancel()
                failed.append(target)
        return done, failed

    async def _pull(self, artifact_id: str, target: str, stop: float) -> None:
        try:
            await self.parts.peers.call(target, Prefetch(artifact_id=artifact_id, worker_id=target),
                                        CallContext(deadline=stop))
        except TensorCastError as exc:
            log.warning("a copy of %s on %s failed: %s", artifact_id, target, exc)
            raise

    async def _alive(self) -> set[str] | None:
        """The workers heartbeating now (None when the global store cannot say: nothing is given up on then)."""
        try:
            workers = await self.parts.gs.list_workers(CallContext().with_timeout(_LIVENESS_POLL))
        except TensorCastError:
            return None
        return {w.worker_id for w in workers if w.alive}

    # ----------------------------------------------------------------- repairs
    async def repair_loop(self) -> None:
        interval = self.parts.config.worker.repair_interval
        while True:
            await asyncio.sleep(interval)
            try:
                await self.repair_once()
            except TensorCastError as exc:
                log.debug("repair pass skipped: %s", exc)
            except Exception:
                log.exception("repair pass failed")

    async def repair_once(self) -> list[Repair]:
        """One pass: start the copies this worker is responsible for; returns them."""
        p, now = self.parts, clock.time()
        self._avoid = {k: until for k, until in self._avoid.items() if until > now}
        ctx = CallContext().with_timeout(10.0)
        short = await p.gs.under_replicated(ctx, _BATCH)
        if not short.artifacts:
            return []
        workers = await p.gs.list_workers(ctx)
        mine = [r for r in plan_repairs(short.artifacts, workers, now, busy=self.busy, avoid=self._avoid)
                if r.source == p.worker_id]
        slots = max(p.config.worker.repair_parallel - len(self.busy), 0)
        by_artifact: dict[str, list[str]] = {}
        for r in mine:
            if r.artifact_id in by_artifact or len(by_artifact) < slots:
                by_artifact.setdefault(r.artifact_id, []).append(r.target)
        for aid, targets in by_artifact.items():
            self.busy.add(aid)
            task = asyncio.ensure_future(self._repair(aid, targets))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return [r for r in mine if r.artifact_id in by_artifact]

    async def _repair(self, artifact_id: str, targets: list[str]) -> None:
        config = self.parts.config.worker
        try:
            done, failed = await self._copy(artifact_id, targets, len(targets), clock.time() + config.repair_timeout)
            for target in failed:  # tried again elsewhere at a later pass
                self._avoid[(artifact_id, target)] = clock.time() + 5 * config.repair_interval
            if done:
                log.info("re-replicated %s onto %s", artifact_id, ", ".join(done))
        finally:
            self.busy.discard(artifact_id)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
