"""A worker's group commit (``worker.commit_group``): a lone commit goes alone and at once; commits that arrive
while one is on its way go together in the next; each caller gets its own outcome, its own error, its own
deadline; nothing is left waiting when the worker stops. Against a scripted store here, and a real global store
at the end."""

from __future__ import annotations

import asyncio
import gc
import time
import warnings
from typing import Any

import pytest

import tensorcast as tc
from tensorcast.config import Config
from tensorcast.context import CallContext
from tensorcast.errors import DeadlineExceeded, InvalidArgument, NotFound, Unavailable
from tensorcast.records import ArtifactInfo, TensorMeta
from tensorcast.wire.caller import Caller
from tensorcast.wire.messages import (
    ArtifactReply,
    CommitArtifact,
    CommitArtifacts,
    CommitOutcome,
    CommitsDone,
    DeleteArtifact,
)
from tensorcast.worker.commit_group import CommitGroup


def _commit(n: int, key: str | None = None) -> CommitArtifact:
    t = TensorMeta(name="t", dtype="uint8", shape=(4,), nbytes=4, digest=f"{n:064x}")
    return CommitArtifact(artifact=ArtifactInfo(id=f"tc-{n:032x}", tensors=(t,), nbytes=4), worker_id="w0", key=key)


def _ctx(seconds: float = 10.0) -> CallContext:
    return CallContext(deadline=time.time() + seconds)


class Store:
    """A scripted global store: each call waits for ``release`` (so the test decides what is on its way), then
    answers every commit with its artifact, except the ids in ``refuse`` (NotFound) or raises ``fail``."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, CallContext]] = []
        self.release = asyncio.Event()
        self.refuse: set[str] = set()
        self.fail: Exception | None = None
        self.delay = 0.0  # seconds each call takes once released

    async def call(self, msg: Any, ctx: CallContext) -> Any:
        self.calls.append((msg, ctx))
        await self.release.wait()
        await asyncio.sleep(self.delay)
        if ctx.deadline is not None and time.time() > ctx.deadline:  # as the store does: nothing started late
            raise DeadlineExceeded(f"{type(msg).__name__}: deadline passed")
        if self.fail is not None:
            raise self.fail
        if isinstance(msg, CommitArtifact):
            if msg.artifact.id in self.refuse:
                raise NotFound(f"artifact {msg.artifact.id} was deleted")
            return ArtifactReply(artifact=msg.artifact)
        assert isinstance(msg, CommitArtifacts)
        return CommitsDone(outcomes=tuple(
            CommitOutcome(code=NotFound.code, message="deleted") if c.artifact.id in self.refuse
            else CommitOutcome(artifact=c.artifact) for c in msg.commits))


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_lone_commit_goes_alone_and_the_ones_behind_it_go_together() -> None:
    async def main() -> None:
        store = Store()
        group = CommitGroup(store.call)
        ctxs = [_ctx(10 + n) for n in range(4)]
        first = asyncio.ensure_future(group.commit(_commit(0), ctxs[0]))
        await _settle()
        assert [type(m) for m, _ in store.calls] == [CommitArtifact]  # at once, alone, with its own context
        assert store.calls[0][1] is ctxs[0]
        rest = [asyncio.ensure_future(group.commit(_commit(n), ctxs[n])) for n in (1, 2, 3)]
        await _settle()
        assert len(store.calls) == 1  # waiting behind the first
        store.release.set()
        got = await asyncio.gather(first, *rest)
        assert [a.id for a in got] == [_commit(n).artifact.id for n in range(4)]
        msg, ctx = store.calls[1]
        assert isinstance(msg, CommitArtifacts) and [c.artifact.id for c in msg.commits] == [a.id for a in got[1:]]
        # The group's call ends by its earliest deadline: the store starts no commit after that commit's own.
        assert ctx.deadline == min(c.deadline or 0 for c in ctxs[1:])
        assert group.grouped == 3

    asyncio.run(main())


def test_each_caller_gets_its_own_outcome_and_its_own_error() -> None:
    async def main() -> None:
        store = Store()
        group = CommitGroup(store.call)
        store.refuse = {_commit(2).artifact.id}
        first = asyncio.ensure_future(group.commit(_commit(0), _ctx()))
        await _settle()
        ctxs = [_ctx() for _ in range(3)]
        rest = [asyncio.ensure_future(group.commit(_commit(n), ctxs[n - 1])) for n in (1, 2, 3)]
        await _settle()
        store.release.set()
        done = await asyncio.gather(first, *rest, return_exceptions=True)
        assert [type(d) for d in done] == [ArtifactInfo, ArtifactInfo, NotFound, ArtifactInfo]
        assert isinstance(done[2], NotFound) and done[2].trace_id == ctxs[1].trace_id

        # The group's call fails: every caller in it gets the error, typed, with its own trace id.
        store.fail = Unavailable("the global store went away")
        ctxs = [_ctx() for _ in range(3)]
        store.release.clear()
        calls = [asyncio.ensure_future(group.commit(_commit(n), ctxs[n - 10])) for n in (10, 11, 12)]
        await _settle()
        store.release.set()
        errors = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(e, Unavailable) for e in errors)
        assert [e.trace_id for e in errors if isinstance(e, Unavailable)] == [c.trace_id for c in ctxs]

    asyncio.run(main())


def test_a_commit_whose_deadline_passes_while_it_queues_is_never_sent() -> None:
    async def main() -> None:
        store = Store()
        group = CommitGroup(store.call)
        first = asyncio.ensure_future(group.commit(_commit(0), _ctx()))
        await _settle()
        hasty = asyncio.ensure_future(group.commit(_commit(1), _ctx(0.05)))
        patient = asyncio.ensure_future(group.commit(_commit(2), _ctx()))
        with pytest.raises(DeadlineExceeded):
            await hasty
        store.release.set()
        assert (await first).id == _commit(0).artifact.id and (await patient).id == _commit(2).artifact.id
        # The store never saw the commit whose put had already failed.
        assert [m.artifact.id for m, _ in store.calls] == [_commit(0).artifact.id, _commit(2).artifact.id]
        with pytest.raises(DeadlineExceeded):  # a deadline already passed: refused before anything is sent
            await group.commit(_commit(3), CallContext(deadline=time.time() - 1))
        assert len(store.calls) == 2

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        asyncio.run(main())
        gc.collect()  # no "exception was never retrieved" from the caller that gave up


def test_a_group_carries_its_earliest_deadline_and_the_others_go_again_when_it_passes() -> None:
    async def main() -> None:
        store = Store()
        store.release.set()
        store.delay = 0.3
        group = CommitGroup(store.call)
        first = asyncio.ensure_future(group.commit(_commit(0), _ctx()))
        await _settle()
        short, long = _ctx(0.4), _ctx()
        hasty = asyncio.ensure_future(group.commit(_commit(1), short))
        patient = asyncio.ensure_future(group.commit(_commit(2), long))
        assert (await first).id == _commit(0).artifact.id
        with pytest.raises(DeadlineExceeded):  # its group's call outlived it: the store started nothing late
            await hasty
        assert (await patient).id == _commit(2).artifact.id  # sent again, alone, within its own deadline
        assert [type(m).__name__ for m, _ in store.calls] == ["CommitArtifact", "CommitArtifacts", "CommitArtifact"]
        assert store.calls[1][1].deadline == short.deadline and store.calls[2][1] is long

    asyncio.run(main())


def test_stopping_fails_what_is_queued_and_on_its_way() -> None:
    async def main() -> None:
        store = Store()
        group = CommitGroup(store.call)
        calls = [asyncio.ensure_future(group.commit(_commit(n), _ctx())) for n in range(3)]
        await _settle()
        await group.close()
        errors = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(e, Unavailable) for e in errors), errors

    asyncio.run(main())


def test_a_group_through_a_real_global_store() -> None:
    """One CommitArtifacts to a global-store process: each commit answered on its own (an invalid key and a
    deleted artifact refused, the others recorded), and what it recorded is what a client reads."""
    with tc.LocalCluster(workers=1) as cluster, tc.connect(cluster.address) as client:

        async def main() -> CommitsDone:
            caller = Caller(Config().wire, token=None, peer_id="test", host_id="test", address=cluster.gs_address)
            try:
                gone = _commit(9)
                await caller.call(gone, _ctx())
                await caller.call(DeleteArtifact(key_or_id=gone.artifact.id), _ctx())
                restored = CommitArtifact(artifact=gone.artifact, worker_id="w0", restored=True)
                bad_key = _commit(2, key="tc-" + "0" * 32)  # keys may not look like artifact ids
                return await caller.call(CommitArtifacts(commits=(_commit(1, "group/one"), bad_key, restored,
                                                                  _commit(3, "group/three"))), _ctx())
            finally:
                await caller.close()

        async def too_many() -> None:
            caller = Caller(Config().wire, token=None, peer_id="test", host_id="test", address=cluster.gs_address)
            try:
                with pytest.raises(InvalidArgument, match="at most"):
                    await caller.call(CommitArtifacts(commits=(_commit(5),) * 1025), _ctx())
            finally:
                await caller.close()

        done = asyncio.run(main())
        asyncio.run(too_many())  # refused whole: nothing of it recorded
        with pytest.raises(NotFound):
            client.artifact(_commit(5).artifact.id)
        assert [o.artifact.id if o.artifact else o.code for o in done.outcomes] == \
            [_commit(1).artifact.id, InvalidArgument.code, NotFound.code, _commit(3).artifact.id]
        assert [a.key for a in client.ls("group/")] == ["group/one", "group/three"]
