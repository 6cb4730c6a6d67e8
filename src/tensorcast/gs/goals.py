"""What the global store answers about replica goals: the artifacts with fewer copies on live workers than
their placement wants, and how many copies are missing.

Owns: that query (``ListUnderReplicated``, and the ``tensorcast_replicas_missing`` gauge), over the backend's
replica goals (``MetadataBackend.replica_goals``) and the workers' liveness as of now. A copy is a distinct live
worker holding a replica in any tier (``ArtifactInfo.copies``). Does not own: repairing (a worker's
``worker.replication`` asks and copies), the goals' storage (the backends).
"""

from __future__ import annotations

import contextlib
from typing import Protocol

from tensorcast.errors import NotFound
from tensorcast.gs.backend import MetadataBackend
from tensorcast.records import ArtifactInfo, WorkerInfo

__all__ = ["under_replicated"]

_PAGE = 1000


class GlobalStore(Protocol):
    """What the query reads of the global store service (``gs.service.GlobalStore``)."""

    backend: MetadataBackend

    async def workers(self) -> list[WorkerInfo]: ...

    async def info(self, artifact_id: str, workers: dict[str, WorkerInfo] | None = None) -> ArtifactInfo: ...


async def under_replicated(gs: GlobalStore, holder: str, limit: int) -> tuple[list[ArtifactInfo], int]:
    """Up to ``limit`` short artifacts' records (those with a replica on ``holder`` only, when it is given),
    and the copies missing over all of them."""
    workers = {w.worker_id: w for w in await gs.workers()}
    alive = {wid for wid, w in workers.items() if w.alive}
    short: list[ArtifactInfo] = []
    missing, after = 0, ""
    while True:
        rows, after = await gs.backend.replica_goals(holder, after, _PAGE)
        for aid, wanted, replicas in rows:
            lack = wanted - len({w for w, _ in replicas if w in alive})
            if lack <= 0:
                continue
            with contextlib.suppress(NotFound):  # expired, not reaped yet
                info = await gs.info(aid, workers)
                missing += lack
                if len(short) < limit:
                    short.append(info)
        if not after:
            return short, missing
