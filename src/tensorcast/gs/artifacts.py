"""The global store's artifact requests: records, key bindings and leases, listing, deleting, replicas.

Owns: the handlers of ``CommitArtifact`` (and ``CommitArtifacts``, a group of them), ``GetArtifact``,
``ListArtifacts``, ``DeleteArtifact``, ``RenewLease``, ``ReleaseLease``, ``AddReplica`` and ``RemoveReplica`` over a
``MetadataBackend``; the ``NotFound`` that says why an artifact or key is gone; reaping (an artifact whose last
copy went, references whose lease ended). Keys are independent names (``gs.refs``): deleting a key unbinds that
key only, deleting by id removes the content with every key, and an artifact goes when no live reference remains.
Does not own: the reference rules (``gs.refs``), storage (the backends), the GS process (``gs.service``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection

from tensorcast import clock
from tensorcast.config import Config
from tensorcast.errors import InvalidArgument, NotFound, TensorCastError, clip
from tensorcast.gs.backend import ArtifactCommit, ArtifactRow, MetadataBackend, Unbound
from tensorcast.gs.read_leases import ReadLeases
from tensorcast.gs.refs import live, renew_outcome
from tensorcast.limits import check_ttl
from tensorcast.records import ArtifactInfo, ReplicaInfo, WorkerInfo
from tensorcast.tensors import ARTIFACT_ID_RE
from tensorcast.wire.messages import (
    ArtifactList,
    ArtifactReply,
    CommitArtifact,
    CommitArtifacts,
    CommitOutcome,
    CommitsDone,
    DeleteArtifact,
    Deleted,
    GetArtifact,
    ListArtifacts,
    ReleaseLease,
    RenewLease,
)

__all__ = ["ArtifactService", "validate_key"]

log = logging.getLogger("tensorcast.gs")
# The most commits one CommitArtifacts may carry (a worker sends at most ``worker.commit_group.MAX_GROUP``).
MAX_COMMIT_GROUP = 1024
EXPIRED = "its lease expired"


def validate_key(key: str) -> None:
    if not key or len(key) > 1024 or any(ord(c) < 32 for c in key):
        raise InvalidArgument(f"invalid key {clip(key)}: 1..1024 printable characters")
    if ARTIFACT_ID_RE.match(key):
        raise InvalidArgument(f"invalid key {clip(key)}: keys may not look like artifact ids")


def _checked(msg: CommitArtifact, now: float) -> ArtifactCommit:
    """A commit's arguments for the backend: its key valid, its TTL turned into an expiry."""
    if msg.key is not None:
        validate_key(msg.key)
    lease = None if msg.ttl is None else now + check_ttl(msg.ttl)
    return ArtifactCommit(msg.artifact, msg.worker_id, msg.key, lease, msg.tiers, msg.restored)


async def _nothing() -> list[tuple[str, str]]:
    return []


def _failed(exc: TensorCastError) -> CommitOutcome:
    return CommitOutcome(code=exc.code, message=exc.message)


def _ref_name(artifact_id: str, key: str | None) -> str:
    return f"key {clip(key)} of artifact {artifact_id}" if key is not None else f"artifact {artifact_id}"


def _deleted(artifact_id: str, done: Unbound, workers: dict[str, WorkerInfo]) -> Deleted:
    """``workers``: at least the holders (``done.holders``), whose addresses the reply names."""
    return Deleted(artifact_id=artifact_id, removed=done.removed, keys=done.keys, replicas=tuple(
        ReplicaInfo(worker_id=w, address=workers[w].address if w in workers else "") for w in done.holders))


class ArtifactService:
    """``workers(ids)``: those workers (every one with None), each marked alive or not as of now."""

    def __init__(self, backend: MetadataBackend, config: Config,
                 workers: Callable[[Collection[str] | None], Awaitable[dict[str, WorkerInfo]]],
                 reads: ReadLeases) -> None:
        self.backend = backend
        self.config = config
        self.workers = workers
        # Gateways' read leases: whatever removes or releases a reference takes them back before it answers.
        self.reads = reads

    async def resolve(self, key_or_id: str) -> str:
        """The artifact id a live key names, or the id itself; ``NotFound`` saying why otherwise."""
        if not key_or_id:
            raise InvalidArgument("empty artifact key or id")
        if ARTIFACT_ID_RE.match(key_or_id):
            return key_or_id
        bound = await self.backend.resolve_key(key_or_id)
        if bound is None:
            raise await self.gone(key_or_id, f"no artifact with key {clip(key_or_id)}")
        if not live(bound[1], clock.time()):
            raise NotFound(f"artifact {clip(key_or_id)} is gone: {EXPIRED}")
        return bound[0]

    async def gone(self, key_or_id: str, plain: str) -> NotFound:
        """The NotFound for a key or id: saying why when the artifact existed (deleted, lease expired,
        evicted from the cache, lost with a worker's memory)."""
        tomb = await self.backend.tombstone(key_or_id)
        if tomb is None:
            return NotFound(plain)
        what = clip(key_or_id) if tomb[0] != key_or_id else tomb[0]
        return NotFound(f"artifact {what} is gone: {tomb[1]}")

    async def reap(self, artifact_id: str, reason: str) -> None:
        """An artifact whose bytes are gone (its last replica evicted or lost): a miss from now on, not an
        entry that lists without a replica."""
        await self.backend.delete_artifact(artifact_id, clock.time(), reason)
        await self.reads.revoke(artifact_id, removed=True)
        log.info("artifact %s is gone: %s", artifact_id, reason)

    async def _row(self, artifact_id: str) -> ArtifactRow:
        """The record of an artifact some live reference keeps (from the instant a lease ends, it is gone)."""
        row = await self.backend.get_artifact(artifact_id)
        if row is None or not row.refs.alive(clock.time()):
            raise await self.gone(artifact_id, f"no artifact {artifact_id}")
        return row

    async def info(self, artifact_id: str, workers: dict[str, WorkerInfo] | None = None,
                   held: list[tuple[str, str]] | None = None) -> ArtifactInfo:
        """The artifact's record with its replicas; ``workers``: workers already read (at least its holders),
        else its holders are read; ``held``: its (worker, tier) replicas already read."""
        row = await self._row(artifact_id)
        replicas = []
        if held is None:
            held = await self.backend.replicas_of(artifact_id)
        if workers is None:
            workers = await self.workers({wid for wid, _ in held})
        for wid, tier in held:
            w = workers.get(wid)
            replicas.append(ReplicaInfo(worker_id=wid, address=w.address if w else "",
                                        host_id=w.host_id if w else "", tier=tier,
                                        alive=bool(w and w.alive), data_address=w.data_address if w else ""))
        now = clock.time()
        owner, expiry = row.refs.ownership(now)
        return ArtifactInfo(
            id=artifact_id, tensors=row.info.tensors, nbytes=row.info.nbytes, keys=row.refs.live_keys(now),
            owner=owner, lease_expiry=expiry, created_at=row.info.created_at, replicas=tuple(replicas),
            policy=row.info.policy, meta=row.info.meta, replicas_wanted=row.info.replicas_wanted,
        )

    # ----------------------------------------------------------------- handlers
    async def commit(self, msg: CommitArtifact) -> ArtifactReply:
        now = clock.time()
        c = _checked(msg, now)
        if not await self.backend.commit_artifact(c.info, c.worker_id, c.key, c.lease_expiry, now, c.tiers,
                                                  restored=c.restored):
            raise await self.gone(c.info.id, f"artifact {c.info.id} was deleted")
        return ArtifactReply(artifact=await self.info(c.info.id))

    async def commit_group(self, msg: CommitArtifacts) -> CommitsDone:
        """Each commit checked on its own (a bad one is answered with its error, the others go on), the rest
        recorded by one ``commit_artifacts`` of the backend, whose error is every one of theirs."""
        if len(msg.commits) > MAX_COMMIT_GROUP:  # one transaction holds the store's loop: bounded
            raise InvalidArgument(f"{len(msg.commits)} commits in one group; at most {MAX_COMMIT_GROUP}")
        now = clock.time()
        outcomes: list[CommitOutcome] = [CommitOutcome()] * len(msg.commits)
        todo: list[tuple[int, ArtifactCommit]] = []
        for i, one in enumerate(msg.commits):
            try:
                todo.append((i, _checked(one, now)))
            except TensorCastError as exc:
                outcomes[i] = _failed(exc)
        try:
            recorded = await self.backend.commit_artifacts([c for _, c in todo], now) if todo else []
        except TensorCastError as exc:
            for i, _ in todo:
                outcomes[i] = _failed(exc)
            return CommitsDone(outcomes=tuple(outcomes))
        # The group's holders read once, not once per commit.
        held = await asyncio.gather(*(self.backend.replicas_of(c.info.id) if ok else _nothing()
                                      for (_, c), ok in zip(todo, recorded, strict=True)))
        workers = await self.workers({wid for replicas in held for wid, _ in replicas})

        async def answer(c: ArtifactCommit, ok: bool, replicas: list[tuple[str, str]]) -> CommitOutcome:
            try:
                if not ok:
                    raise await self.gone(c.info.id, f"artifact {c.info.id} was deleted")
                return CommitOutcome(artifact=await self.info(c.info.id, workers, replicas))
            except TensorCastError as exc:
                return _failed(exc)

        # All at once: on etcd each answer is a read of its own (on SQLite they run one after another anyway).
        answers = await asyncio.gather(*(answer(c, ok, replicas) for (_, c), ok, replicas
                                         in zip(todo, recorded, held, strict=True)))
        for (i, _), out in zip(todo, answers, strict=True):
            outcomes[i] = out
        return CommitsDone(outcomes=tuple(outcomes))

    async def get(self, msg: GetArtifact) -> ArtifactReply:
        return ArtifactReply(artifact=await self.info(await self.resolve(msg.key_or_id)))

    async def list(self, msg: ListArtifacts, workers: dict[str, WorkerInfo]) -> ArtifactList:
        if msg.limit < 1:
            raise InvalidArgument(f"limit must be >= 1, got {msg.limit}")
        # A page is at most gs.list_page_size: the caller continues from the cursor.
        entries, cursor = await self.backend.list_artifacts(
            msg.prefix, min(msg.limit, self.config.gs.list_page_size), msg.after, clock.time())
        infos: dict[str, ArtifactInfo | None] = {}
        out, keys = [], []
        for key, aid in entries:
            if aid not in infos:
                try:
                    infos[aid] = await self.info(aid, workers)
                except NotFound:
                    infos[aid] = None  # expired, not reaped yet
            info = infos[aid]
            if info is not None:
                out.append(info)
                keys.append(key or "")
        return ArtifactList(artifacts=tuple(out), next=cursor, entry_keys=tuple(keys))

    async def delete(self, msg: DeleteArtifact) -> Deleted:
        """By id: the content, with every key. By key: that key only; the content goes with its last
        reference."""
        aid = await self.resolve(msg.key_or_id)
        if ARTIFACT_ID_RE.match(msg.key_or_id):
            if await self.backend.get_artifact(aid) is None:
                await self.reads.revoke(aid, removed=True)  # a delete again after one cut short: finish it
                raise NotFound(f"no artifact {msg.key_or_id}")
            done = Unbound(True, tuple(await self.backend.delete_artifact(aid, clock.time(), "deleted")))
        else:
            unbound = await self.backend.unbind(aid, msg.key_or_id, clock.time(), "deleted")
            if unbound is None:  # unbound meanwhile
                raise await self.gone(msg.key_or_id, f"no artifact with key {clip(msg.key_or_id)}")
            done = unbound
        log.debug("deleted %s (artifact %s, removed: %s)", msg.key_or_id, aid, done.removed)
        await self.reads.revoke(aid, done.removed)
        return _deleted(aid, done, await self.workers(done.holders))

    async def _leased(self, artifact_id: str, key: str | None, verb: str) -> None:
        """``InvalidArgument`` unless reference ``key`` of the artifact is a live lease."""
        if key is not None:
            validate_key(key)
        row = await self._row(artifact_id)
        outcome = renew_outcome(row.refs, key, clock.time())
        if outcome == "permanent":
            what = "bound permanently (put without a ttl)" if key is not None else "system-owned"
            instead = "delete the key" if key is not None else "delete it"
            raise InvalidArgument(f"{_ref_name(artifact_id, key)} is {what}: it has no lease to {verb}"
                                  + ("" if verb == "renew" else f"; {instead} instead of releasing"))
        if outcome == "missing":
            if key is not None:
                raise NotFound(f"{_ref_name(artifact_id, key)}: the key is not bound to it (or its lease ended)")
            raise InvalidArgument(f"artifact {artifact_id} has no lease of its own (a put without a key); its "
                                  f"leases are its keys' ({clip(row.refs.live_keys(clock.time()))}): "
                                  f"{verb} through a handle of one of them")

    async def renew(self, msg: RenewLease) -> ArtifactReply:
        check_ttl(msg.ttl)
        await self._leased(msg.artifact_id, msg.key, "renew")
        if not await self.backend.set_lease(msg.artifact_id, msg.key, clock.time() + msg.ttl):
            raise NotFound(f"{_ref_name(msg.artifact_id, msg.key)}: its lease ended meanwhile")
        return ArtifactReply(artifact=await self.info(msg.artifact_id))

    async def release(self, msg: ReleaseLease) -> Deleted:
        """End the handle's own lease; the artifact goes only if nothing else keeps it."""
        await self._leased(msg.artifact_id, msg.key, "release")
        done = await self.backend.unbind(msg.artifact_id, msg.key, clock.time(), "its lease was released")
        if done is None:
            raise NotFound(f"{_ref_name(msg.artifact_id, msg.key)}: released meanwhile")
        await self.reads.revoke(msg.artifact_id, done.removed)
        return _deleted(msg.artifact_id, done, await self.workers(done.holders))

    async def reap_expired(self, now: float) -> None:
        """Unbind the key bindings and drop the anonymous leases whose lease ended; an artifact left with no
        live reference is deleted (holders drop it at their next heartbeat)."""
        for aid, key in await self.backend.expired_references(now):
            done = await self.backend.unbind(aid, key, now, EXPIRED, expired_only=True)
            if done is not None and done.removed:
                await self.reads.revoke(aid, removed=True)
                log.info("lease of artifact %s expired", aid)
