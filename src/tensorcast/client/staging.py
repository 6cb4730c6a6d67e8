"""Fetching one rank's slices of a weight version into staging, group by group, copy overlapped with fetch.

Owns: which path the bytes take — a replica on this host: mapped and sliced here (zero-copy for contiguous
slices); else through a worker on this host (``via``): it materializes the slices as a view artifact, pulled
worker-to-worker over the data plane (only the slices' bytes cross the network, and only those of tensors
whose blobs it does not hold yet), and this process maps it — or, with ``whole`` (every rank of the engine is
on this host), the worker pulls the whole version once (the ranks' concurrent requests share one transfer;
only blobs it lacks move: once it holds a version whole, a delta moves only what changed) and each rank slices
it here; else straight from a remote holder, which cuts the slices — and cutting the work into a few groups by
size, so that while one group is being absorbed into staging (on a thread) the next is being fetched. Reports
the bytes fetched. Does not own: deciding which tensors changed, or staging and activation
(``client.binding``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tensorcast.client.publisher import ClientPort
from tensorcast.context import CallContext
from tensorcast.records import ArtifactInfo, SliceSpec, WorkerInfo
from tensorcast.views import view_artifact_id
from tensorcast.wire.caller import Caller
from tensorcast.wire.messages import GetArtifact, Prefetch

__all__ = ["GROUP_MIN_BYTES", "MAX_GROUPS", "Job", "StageStats", "groups_of", "stage"]

MAX_GROUPS = 4  # fetches per swap (each a view artifact when staged through a worker)
GROUP_MIN_BYTES = 16 * 1024**2  # below this, one group: overlap gains less than a round trip costs

Key = tuple[str, str]  # (bound tensor, source tensor of the version)


@dataclass(frozen=True)
class Job:
    key: Key
    source: str
    specs: tuple[SliceSpec, ...]
    nbytes: int


@dataclass
class StageStats:
    path: str = ""  # local | via <worker> | remote
    fetched_bytes: int = 0  # bytes brought to this host (pulled by the worker, or fetched here)
    groups: int = 0


def groups_of(jobs: Sequence[Job], max_groups: int = MAX_GROUPS, min_bytes: int = GROUP_MIN_BYTES) -> list[list[Job]]:
    """Consecutive groups of about equal bytes: at most ``max_groups``, none under ``min_bytes`` (but one)."""
    total = sum(j.nbytes for j in jobs)
    count = max(1, min(max_groups, total // max(1, min_bytes), len(jobs)))
    target = total / count
    out: list[list[Job]] = [[]]
    filled = 0
    for job in jobs:
        if out[-1] and filled >= target * len(out) and len(out) < count:
            out.append([])
        out[-1].append(job)
        filled += job.nbytes
    return [g for g in out if g]


class _Fetch:
    """One path's fetch of a group: ``{source name: tensor}`` (mapped or fetched, contiguous)."""

    def __init__(self, client: ClientPort, info: ArtifactInfo, like: str, via: WorkerInfo | None, meta: dict[str, str],
                 ctx: CallContext, stats: StageStats, whole: bool = False) -> None:
        self.client, self.info, self.like, self.via, self.meta, self.ctx, self.stats = \
            client, info, like, via, meta, ctx, stats
        here = [r for r in info.replicas if r.alive and r.address and client.locality.same_host(r.host_id)]
        self.local = bool(here)
        self.whole = whole and not here and via is not None
        stats.path = "local" if here else "remote" if via is None else \
            f"via {via.worker_id}{' (whole)' if self.whole else ''}"

    async def _pull_whole(self) -> None:
        """Have ``via`` hold the whole version (a no-op where it does); from then on this host has it."""
        assert self.via is not None
        msg = Prefetch(artifact_id=self.info.id, worker_id=self.via.worker_id)
        done = await self.client.caller.call(msg, self.ctx, address=self.via.address)
        self.stats.fetched_bytes += done.bytes_moved
        if done.artifact is not None:
            self.info = done.artifact
        self.local, self.whole = True, False

    async def __call__(self, group: list[Job]) -> dict[str, Any]:
        slices = {j.source: j.specs for j in group}
        names = tuple(slices)
        reader = self.client.reader
        if self.whole:
            await self._pull_whole()
        if self.local or self.via is None:
            out, diag = await reader.materialize(self.info, names, self.like, slices,
                                                 "local_only" if self.local else "auto", ctx=self.ctx)
            self.stats.fetched_bytes += diag.bytes_moved
            return dict(out)
        caller: Caller = self.client.caller
        view_id = view_artifact_id(self.info.id, slices)
        msg = Prefetch(artifact_id=self.info.id, worker_id=self.via.worker_id, view=slices, view_id=view_id,
                       view_meta=self.meta)
        done = await caller.call(msg, self.ctx, address=self.via.address)
        self.stats.fetched_bytes += done.bytes_moved
        view = (await caller.call(GetArtifact(key_or_id=view_id), self.ctx)).artifact
        out, _ = await reader.materialize(view, names, self.like, None, "local_only", ctx=self.ctx)
        return dict(out)


async def stage(client: ClientPort, info: ArtifactInfo, jobs: Sequence[Job], *, like: str, via: WorkerInfo | None,
                meta: dict[str, str], ctx: CallContext,
                absorb: Callable[[dict[Key, Any]], None], whole: bool = False) -> StageStats:
    """Fetch ``jobs`` group by group; ``absorb({key: tensor})`` runs on a thread for each group while the
    next one is fetched. ``whole``: ``via`` pulls the whole version (see the module's docstring)."""
    stats = StageStats()
    fetch = _Fetch(client, info, like, via, meta, ctx, stats, whole)
    pending: asyncio.Future[None] | None = None
    try:
        for group in groups_of(jobs):
            got = await fetch(group)
            stats.groups += 1
            if pending is not None:
                await pending
            pending = asyncio.ensure_future(asyncio.to_thread(absorb, {j.key: got[j.source] for j in group}))
        if pending is not None:
            await pending
            pending = None
    finally:
        if pending is not None:  # a fetch failed while a group was being absorbed: let the thread finish
            with contextlib.suppress(BaseException):
                await pending
    return stats
