"""Read leases: a gateway holding an artifact's checked memory copy answers look-ups of its id itself, and the
store takes that back before a delete returns.

A same-host reader's look-up otherwise makes two trips (caller -> gateway -> store) before it maps bytes the
gateway already holds. Under a read lease the gateway answers from what the store told it when it granted the
lease, so the reader makes one trip, to its own host. What keeps that answer true: only a system-owned
artifact gets one (a leased artifact can end by time alone), the lease is recorded beside the artifact in the
backend, atomically with checking the artifact is still there (so a delete either sees a grant or makes it
fail), and whatever removes or releases a reference of the artifact revokes its leases before its reply is
sent: each holder is told (``RevokeReads``), and the revocation finishes once every holder acknowledged or its
lease ended. A holder that cannot be told (stopped, partitioned) stops answering by its own clock first: it
counts the lease from before it asked, shortened by a margin (``worker.held_reads``). So a delete waits at
most ``gs.read_lease_seconds`` for a holder that does not answer, and a look-up through any gateway after a
delete returned says the artifact is gone.

Owns: ``ReadLeases`` (grant, revoke). Does not own: the holder's side (``worker.held_reads``), when an artifact
goes (``gs.artifacts``), or the records (the backends' ``grant_read``, ``reads_of``, ``end_reads``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection

from tensorcast import clock
from tensorcast.context import CallContext
from tensorcast.errors import TensorCastError
from tensorcast.gs.backend import MetadataBackend
from tensorcast.records import ArtifactInfo, WorkerInfo
from tensorcast.wire.caller import Caller
from tensorcast.wire.messages import RevokeReads

__all__ = ["ReadLeases"]

log = logging.getLogger("tensorcast.gs")
# The least time a revocation is given to reach a holder whose lease has (by this store's clock) ended already.
_TELL_AT_LEAST = 0.5


class ReadLeases:
    """``seconds``: a lease's length (0, or no ``caller`` to reach workers with: none granted); ``workers(ids)``:
    those workers' records (their addresses)."""

    def __init__(self, backend: MetadataBackend, seconds: float, caller: Caller | None,
                 workers: Callable[[Collection[str] | None], Awaitable[dict[str, WorkerInfo]]]) -> None:
        self.backend = backend
        self.seconds = seconds if caller is not None else 0.0
        self.caller = caller
        self.workers = workers

    async def grant(self, info: ArtifactInfo, worker_id: str) -> float:
        """Seconds of the lease granted to ``worker_id`` on ``info`` (0: none: leases are off, the artifact is
        leased rather than system-owned, the worker is not registered, or the artifact went meanwhile)."""
        if self.seconds <= 0 or info.owner != "system" or not await self.workers({worker_id}):
            return 0.0
        if not await self.backend.grant_read(info.id, worker_id, clock.time() + self.seconds):
            return 0.0
        # Its last permanent reference may have gone meanwhile (a revocation that read the leases before this
        # grant landed missed it): then the lease is not handed out (its record is revoked with the artifact).
        row = await self.backend.get_artifact(info.id)
        if row is None or row.refs.ownership(clock.time())[0] != "system":
            return 0.0
        return self.seconds

    async def revoke(self, artifact_id: str, removed: bool) -> None:
        """Take back every lease on the artifact: once this returns, no holder answers for it. ``removed``: the
        artifact is gone (no grant can follow: its leases are forgotten too). Runs to its end even when the
        request that started it is cancelled (its deadline passed), so a delete's revocation is never cut
        short after the delete committed."""
        if self.caller is None:
            return
        await asyncio.shield(asyncio.ensure_future(self._revoke(artifact_id, removed)))

    async def _revoke(self, artifact_id: str, removed: bool) -> None:
        # Leases that ended by this store's clock a lease ago are still told: another store process that
        # granted one may read its clock a little behind this one's.
        held = await self.backend.reads_of(artifact_id, clock.time() - self.seconds)
        if not held:
            return
        workers = await self.workers({w for w, _ in held})
        await asyncio.gather(*(self._tell(workers.get(w), w, artifact_id, until) for w, until in held))
        if removed:
            await self.backend.end_reads(artifact_id, held)

    async def _tell(self, worker: WorkerInfo | None, worker_id: str, artifact_id: str, until: float) -> None:
        """Tell one holder; if it cannot be told by the time its lease ends, wait for that end."""
        try:
            if worker is None or not worker.address or self.caller is None:
                raise ConnectionError("no address")
            # Named: a worker now at that address that is not the holder refuses it, and the lease is waited out.
            deadline = max(until, clock.time() + _TELL_AT_LEAST)
            await self.caller.call(RevokeReads(artifact_ids=(artifact_id,), worker_id=worker_id),
                                   CallContext(deadline=deadline), address=worker.address)
            return
        except (TimeoutError, TensorCastError, OSError) as exc:
            log.info("could not revoke worker %s's read lease on %s (%s): waiting %.2fs for it to end", worker_id,
                     artifact_id, exc, max(0.0, until - clock.time()))
        await asyncio.sleep(max(0.0, until - clock.time()))
