"""Group commit of a worker's artifact records: the commits that arrive while one is on its way to the global
store go together in the next, as one ``CommitArtifacts`` (one round trip, one transaction, one fsync at most),
instead of queueing one behind the other.

Owns: ``CommitGroup`` — queueing commits, sending one group at a time, and handing each caller its own outcome
(its artifact as recorded, or its typed error). A commit that finds nothing on its way goes at once, alone, as a
plain ``CommitArtifact``, so a lone put waits no longer than it would without grouping; the batch forms only
while the store is busy with the previous one. The group's call carries the earliest deadline of its commits:
the store starts none of them after that commit's deadline, as it would not start that commit alone (what
``worker.unrecorded`` counts on before it settles a failed put's copy); each caller waits until its own
deadline, and a group that ran out of time goes again with the commits whose deadlines have not passed (a commit
is idempotent). Does not own: what a commit means (``gs.artifacts``) or what a put does when its commit fails
(``worker.storage``, ``worker.unrecorded``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from tensorcast.context import CallContext
from tensorcast.errors import DeadlineExceeded, InternalError, TensorCastError, Unavailable, error_from_code
from tensorcast.records import ArtifactInfo
from tensorcast.wire.messages import CommitArtifact, CommitArtifacts

__all__ = ["CommitGroup"]

# At most this many commits in one CommitArtifacts: bounds the store's transaction and the frame.
MAX_GROUP = 64

_Waiter = tuple[CommitArtifact, CallContext, "asyncio.Future[ArtifactInfo]"]


class CommitGroup:
    """``call(message, ctx)`` sends a request to the global store and returns its reply (``Caller.call``)."""

    def __init__(self, call: Callable[[Any, CallContext], Awaitable[Any]], max_group: int = MAX_GROUP) -> None:
        self._call = call
        self._max = max_group
        self._queue: list[_Waiter] = []
        self._sender: asyncio.Task[None] | None = None  # sending the queue, one call at a time
        self.grouped = 0  # commits that went in a group of more than one (a signal for metrics and tests)

    async def commit(self, msg: CommitArtifact, ctx: CallContext) -> ArtifactInfo:
        """Record ``msg`` at the global store, alone or with the commits queued beside it."""
        ctx.check("CommitArtifact")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[ArtifactInfo] = loop.create_future()
        fut.add_done_callback(_retrieved)  # a caller that gave up leaves no "never retrieved" error behind
        self._queue.append((msg, ctx, fut))
        if self._sender is None:
            self._sender = loop.create_task(self._send_all())
        try:
            async with asyncio.timeout(ctx.remaining()):
                return await asyncio.shield(fut)  # a caller that stops waiting leaves the group's call running
        except TimeoutError:
            raise DeadlineExceeded("CommitArtifact to the global store: deadline exceeded",
                                   trace_id=ctx.trace_id) from None

    async def close(self) -> None:
        """Stop sending: what is queued or on its way fails with ``Unavailable``."""
        if self._sender is not None:
            self._sender.cancel()
            await asyncio.gather(self._sender, return_exceptions=True)
        left, self._queue = self._queue, []
        _fail(left, Unavailable("the worker is stopping"))

    async def _send_all(self) -> None:
        try:
            while self._queue:
                # A commit whose caller's deadline passed while it queued is not sent: its put has failed.
                late = [w for w in self._queue if not _time_left(w[1])]
                _fail(late, DeadlineExceeded("CommitArtifact: deadline passed before it was sent"))
                ready = [w for w in self._queue if _time_left(w[1])]
                group, self._queue = ready[: self._max], ready[self._max :]
                if group:
                    await self._send(group)
        finally:  # (no await between the empty queue and here: a commit queued meanwhile starts a sender)
            self._sender = None

    async def _send(self, group: list[_Waiter]) -> None:
        error: TensorCastError | None = None
        try:
            if len(group) == 1:
                msg, ctx, fut = group[0]
                reply = await self._call(msg, ctx)
                if not fut.done():
                    fut.set_result(reply.artifact)
                return
            deadlines = [ctx.deadline for _, ctx, _ in group if ctx.deadline is not None]
            ctx = CallContext(trace_id=group[0][1].trace_id, deadline=min(deadlines, default=None))
            done = await self._call(CommitArtifacts(commits=tuple(m for m, _, _ in group)), ctx)
            if len(done.outcomes) != len(group):
                error = InternalError(f"{len(done.outcomes)} outcomes for {len(group)} commits")
        except TensorCastError as exc:
            error = exc
        except asyncio.CancelledError:
            _fail(group, Unavailable("the worker is stopping"))
            raise
        except Exception as exc:  # a bug: every caller hears of it, and the next group still goes
            error = InternalError(f"group commit failed: {type(exc).__name__}: {exc}")
        if error is not None:
            if isinstance(error, DeadlineExceeded) and len(group) > 1:  # the earliest deadline passed: the rest
                again = [w for w in group if not w[2].done() and _time_left(w[1])]  # go again, first
                self._queue[:0] = again
                group = [w for w in group if w not in again]
            _fail(group, error)
            return
        self.grouped += len(group)
        for (_, ctx, fut), out in zip(group, done.outcomes, strict=True):
            if fut.done():
                continue
            if out.artifact is not None:
                fut.set_result(out.artifact)
            else:
                fut.set_exception(error_from_code(out.code or InternalError.code, out.message, ctx.trace_id))


def _fail(waiters: list[_Waiter], error: TensorCastError) -> None:
    """``error`` for each waiter still waiting: itself for one, a copy with its own trace id for several."""
    for _, ctx, fut in waiters:
        if not fut.done():
            fut.set_exception(error if len(waiters) == 1 else error_from_code(error.code, error.message, ctx.trace_id))


def _time_left(ctx: CallContext) -> bool:
    left = ctx.remaining()
    return left is None or left > 0


def _retrieved(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()
