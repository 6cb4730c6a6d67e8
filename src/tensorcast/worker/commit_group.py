"""Group commit of a worker's artifact records: the commits that arrive while one is on its way to the global
store go together in the next, as one ``CommitArtifacts`` (one round trip, one transaction, one fsync at most),
instead of queueing one behind the other.

Owns: ``CommitGroup`` — queueing commits, sending one group at a time, and handing each caller its own outcome
(its artifact as recorded, or its typed error). A commit that finds nothing on its way goes at once, alone, as a
plain ``CommitArtifact``, so a lone put waits no longer than it would without grouping; the batch forms only
while the store is busy with the previous one. Each caller waits until its own deadline; the group's call runs
until the latest of them. Does not own: what a commit means (``gs.artifacts``) or what a put does when its
commit fails (``worker.storage``, ``worker.unrecorded``).
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
# Calls on their way at once: the commits that arrive while all are out form the next group.
IN_FLIGHT = 1

_Waiter = tuple[CommitArtifact, CallContext, "asyncio.Future[ArtifactInfo]"]


class CommitGroup:
    """``call(message, ctx)`` sends a request to the global store and returns its reply (``Caller.call``)."""

    def __init__(self, call: Callable[[Any, CallContext], Awaitable[Any]], max_group: int = MAX_GROUP,
                 in_flight: int = IN_FLIGHT) -> None:
        self._call = call
        self._max, self._in_flight = max_group, in_flight
        self._queue: list[_Waiter] = []
        self._senders: set[asyncio.Task[None]] = set()
        self.grouped = 0  # commits that went in a group of more than one (a signal for metrics and tests)

    async def commit(self, msg: CommitArtifact, ctx: CallContext) -> ArtifactInfo:
        """Record ``msg`` at the global store, alone or with the commits queued beside it."""
        ctx.check("CommitArtifact")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[ArtifactInfo] = loop.create_future()
        fut.add_done_callback(_retrieved)  # a caller that gave up leaves no "never retrieved" error behind
        self._queue.append((msg, ctx, fut))
        if len(self._senders) < self._in_flight:
            sender = loop.create_task(self._send_all())
            self._senders.add(sender)
            sender.add_done_callback(self._senders.discard)
        try:
            async with asyncio.timeout(ctx.remaining()):
                return await asyncio.shield(fut)  # a caller that stops waiting leaves the group's call running
        except TimeoutError:
            raise DeadlineExceeded("CommitArtifact to the global store: deadline exceeded",
                                   trace_id=ctx.trace_id) from None

    async def close(self) -> None:
        """Stop sending: what is queued or on its way fails with ``Unavailable``."""
        senders = list(self._senders)
        for sender in senders:
            sender.cancel()
        await asyncio.gather(*senders, return_exceptions=True)
        left, self._queue = self._queue, []
        _fail(left, Unavailable("the worker is stopping"))

    async def _send_all(self) -> None:
        while self._queue:
            group, self._queue = self._queue[: self._max], self._queue[self._max :]
            await self._send(group)

    async def _send(self, group: list[_Waiter]) -> None:
        error: TensorCastError | None = None
        try:
            if len(group) == 1:
                msg, ctx, fut = group[0]
                reply = await self._call(msg, ctx)
                if not fut.done():
                    fut.set_result(reply.artifact)
                return
            deadlines = [ctx.deadline for _, ctx, _ in group]
            ctx = CallContext(trace_id=group[0][1].trace_id,
                              deadline=None if None in deadlines else max(d for d in deadlines if d is not None))
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


def _retrieved(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()
