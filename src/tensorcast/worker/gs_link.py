"""A worker's link to the global store: typed metadata calls, registration and heartbeats.

Owns: every request a worker makes of the global store, each with its reply type (no frame handling
elsewhere; artifact commits are grouped while the store is busy, ``worker.commit_group``), registering
(retried until a deadline; the storage role then re-announces its replicas), the heartbeat loop (usage and
network pressure out; artifacts to drop and "register again" back), and acknowledging drops. Does not own:
what the worker holds (``worker.storage``) or the peers it talks to (``worker.peers``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from tensorcast import clock
from tensorcast.context import CallContext
from tensorcast.errors import TensorCastError, Unavailable
from tensorcast.records import ArtifactInfo, InstanceInfo, WorkerInfo, WorkerLoad
from tensorcast.wire.caller import Caller
from tensorcast.wire.messages import (
    AddReplica,
    CommitArtifact,
    GetArtifact,
    Heartbeat,
    ListInstances,
    ListUnderReplicated,
    ListWorkers,
    RegisterWorker,
    RemoveReplica,
    UnderReplicated,
)
from tensorcast.wire.messages import Request as StoreRequest
from tensorcast.wire.rpc import Request
from tensorcast.worker.commit_group import CommitGroup

__all__ = ["GlobalStoreLink"]

log = logging.getLogger("tensorcast.worker")
R = TypeVar("R")

# Seconds a background call (registration attempt, replica bookkeeping) may take.
_CALL_TIMEOUT = 5.0


class GlobalStoreLink:
    """``caller`` is the worker's caller, whose default address is the global store."""

    def __init__(self, caller: Caller, worker_id: str, heartbeat_interval: float) -> None:
        self.caller = caller
        self.worker_id = worker_id
        self.heartbeat_interval = heartbeat_interval
        self.incarnation = 0
        self._dropped: set[str] = set()  # dropped since the last heartbeat, acknowledged with the next one
        self.commits = CommitGroup(caller.call)

    @staticmethod
    def _ctx(timeout: float = _CALL_TIMEOUT) -> CallContext:
        return CallContext(deadline=clock.time() + timeout)

    # ----------------------------------------------------------------- registration and heartbeats
    async def register(self, info: Callable[[], WorkerInfo], announce: Callable[[], Awaitable[None]],
                       deadline: float) -> None:
        """Register (again, after a restart or when the store forgot this worker), then ``announce`` the
        replicas held here. Retries until ``deadline``; then ``Unavailable``."""
        while True:
            try:
                reply = await self.caller.call(RegisterWorker(worker=info()), self._ctx())
                self.incarnation = reply.incarnation
                await announce()
                return
            except TensorCastError as exc:
                if clock.time() > deadline:
                    raise Unavailable(f"cannot register with the global store: {exc}") from exc
                await asyncio.sleep(0.2)

    def dropped(self, artifact_id: str) -> None:
        """This worker dropped its replicas of ``artifact_id``: acknowledged with the next heartbeat."""
        self._dropped.add(artifact_id)

    def kept(self, artifact_id: str) -> None:
        """The artifact was put here again: nothing to acknowledge."""
        self._dropped.discard(artifact_id)

    async def heartbeat_loop(self, load: Callable[[], WorkerLoad], drop: Callable[[str], None],
                             reregister: Callable[[], Awaitable[None]],
                             healthy: Callable[[], str] = lambda: "") -> None:
        """Every ``heartbeat_interval``: report ``load()``, ``drop`` what the store says was deleted, and
        ``reregister`` when the store does not know this worker (its database was replaced). While
        ``healthy()`` names a problem (its data plane stopped serving), no heartbeat is sent: the cluster
        takes the worker for dead instead of sending readers to it."""
        interval = self.heartbeat_interval
        while True:
            await asyncio.sleep(interval)
            problem = healthy()
            if problem:
                log.error("not heartbeating: %s", problem)
                continue
            dropped = tuple(self._dropped)
            beat = Heartbeat(worker_id=self.worker_id, incarnation=self.incarnation, dropped=dropped, load=load())
            try:
                reply = await self.caller.call(beat, self._ctx(max(interval * 3, 2.0)))
            except TensorCastError as exc:
                log.warning("heartbeat to the global store failed: %s", exc)
                continue
            self._dropped.difference_update(dropped)
            if reply.reregister:
                log.warning("the global store does not know this worker: registering again")
                with contextlib.suppress(TensorCastError):
                    await reregister()
                continue
            for aid in reply.drop:
                drop(aid)

    # ----------------------------------------------------------------- artifacts and replicas
    async def get_artifact(self, key_or_id: str, ctx: CallContext) -> ArtifactInfo:
        return (await self.caller.call(GetArtifact(key_or_id=key_or_id), ctx)).artifact

    async def commit_artifact(self, info: ArtifactInfo, ctx: CallContext, *, key: str | None = None,
                              ttl: float | None = None, tiers: tuple[str, ...] = ("memory",),
                              restored: bool = False) -> ArtifactInfo:
        msg = CommitArtifact(artifact=info, worker_id=self.worker_id, key=key, ttl=ttl, tiers=tiers,
                             restored=restored)
        return await self.commits.commit(msg, ctx)

    async def add_replica(self, artifact_id: str, tiers: tuple[str, ...], ctx: CallContext | None = None, *,
                          restored: bool = False) -> None:
        """Record another tier/replica of an artifact the store knows (``NotFound`` if it does not, or if
        ``restored`` and the copy was to be dropped)."""
        msg = AddReplica(artifact_id=artifact_id, worker_id=self.worker_id, tiers=tiers, restored=restored)
        await self.caller.call(msg, ctx or self._ctx())

    async def remove_replica(self, artifact_id: str, tier: str) -> None:
        """Best effort: a replica that went without the store asking (eviction, a cold TTL)."""
        with contextlib.suppress(TensorCastError):
            await self.caller.call(RemoveReplica(artifact_id=artifact_id, worker_id=self.worker_id, tier=tier),
                                   self._ctx())

    async def under_replicated(self, ctx: CallContext, limit: int = 100) -> UnderReplicated:
        """The artifacts this worker holds a replica of that have fewer copies on live workers than wanted."""
        return await self.caller.call(ListUnderReplicated(holder=self.worker_id, limit=limit), ctx)

    async def close(self) -> None:
        """Stop sending commits (what is queued fails with ``Unavailable``)."""
        await self.commits.close()

    # ----------------------------------------------------------------- signals
    async def list_workers(self, ctx: CallContext) -> list[WorkerInfo]:
        return list((await self.caller.call(ListWorkers(), ctx)).workers)

    async def list_instances(self, ctx: CallContext) -> list[InstanceInfo]:
        return list((await self.caller.call(ListInstances(), ctx)).instances)

    async def call(self, msg: StoreRequest[R], ctx: CallContext) -> R:
        """A request of this worker's own to the store, its reply typed by the request."""
        return await self.caller.call(msg, ctx)

    async def forward(self, msg: Any, ctx: CallContext) -> Any:
        """Relay a caller's metadata request and return the store's reply (checked against its type)."""
        return await self.caller.forward(msg, ctx)

    async def relay(self, msg: Any, req: Request) -> Any:
        """A request handler for the roles that relay callers' metadata requests to the store as they are."""
        return await self.forward(msg, req.ctx)
