"""The etcd backend's artifacts: records, references (key bindings, the anonymous hold or lease), replicas,
pending drops and tombstones, as optimistic etcd transactions. ``gs.etcd`` composes this with the rest.

Owns: the artifact operations of ``MetadataBackend`` that write, on the layout that ``gs.etcd`` describes,
and the one-time conversion of records written before keys were references (``convert_legacy``, run when a
store opens). Every transaction that changes an artifact's references rewrites its record ``a/{artifact}``
(changed or not), so two racing changes conflict on it and the later one decides again; an artifact's
bindings ``ka/{artifact}/`` are therefore read after its record, outside the compare. Does not own: the reads
(``gs.etcd_reads``), the rules (``gs.refs``), the record encodings (``gs.etcd_records``), workers, instances
or shard leases (``gs.etcd``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from tensorcast.gs import etcd_goals
from tensorcast.gs import etcd_records as codec
from tensorcast.gs.backend import Unbound
from tensorcast.gs.etcd_client import Txn, prefix_end
from tensorcast.gs.etcd_reads import Bindings, EtcdArtifactReads
from tensorcast.gs.refs import live, merge_lease, unbind_outcome
from tensorcast.records import ArtifactInfo

__all__ = ["EtcdArtifacts"]

# Keys unbound per transaction when an artifact is deleted (a check and up to 4 writes each), leaving room
# under etcd's 128 operations for the record, its replicas and its holders' drops.
_KEY_BATCH = 20
_SCAN = 256  # records read per range while converting old ones


class _TooManyKeys(Exception):
    """Deleting the artifact whole would not fit in one transaction beside its keys."""


class EtcdArtifacts(EtcdArtifactReads):
    # ----------------------------------------------------------------- commits
    async def commit_artifact(self, info: ArtifactInfo, worker_id: str, key: str | None,
                              lease_expiry: float | None, now: float, tiers: tuple[str, ...] = ("memory",),
                              restored: bool = False) -> bool:
        aid = info.id

        async def decide(tx: Txn) -> bool:
            keyed = [self._k("k", key)] if key is not None else []
            # One round trip for all reads: the replica bookkeeping, the copies wanted, the key.
            await tx.prefetch([*self._replica_keys(aid, worker_id), self._k("g", aid), *keyed])
            raw = await tx.get(self._k("a", aid))
            if restored and await self._deleted_here(tx, aid, worker_id):
                return False
            tx.delete(self._k("t", aid))
            rec = codec.ARTIFACT.decode(raw) if raw else codec.Artifact(info.tensors, info.nbytes, now, None,
                                                                        info.policy, dict(info.meta), anonymous=False)
            await etcd_goals.note(tx, self._k("g", aid), info.replicas_wanted, new=raw is None)
            if key is None:
                self._hold(tx, aid, rec, lease_expiry)
            else:
                await self._bind(tx, key, aid, lease_expiry)
            await self._add_replicas(tx, aid, rec, worker_id, tiers)
            return True

        return await self.etcd.atomically(decide)

    def _hold(self, tx: Txn, aid: str, rec: codec.Artifact, expiry: float | None) -> None:
        """Merge ``expiry`` onto the anonymous reference (the record is written by the caller)."""
        new = merge_lease(rec.lease_expiry if rec.anonymous is not False else False, expiry)
        self._set_expiry(tx, aid, rec.lease_expiry, new)
        rec.lease_expiry, rec.anonymous = new, True

    async def _bind(self, tx: Txn, key: str, aid: str, expiry: float | None) -> None:
        """Bind ``key`` (merged onto its binding to this artifact; moved from another one, which keeps what
        the key held as its anonymous reference)."""
        raw = await tx.get(self._k("k", key))
        old = codec.binding(raw) if raw is not None else None
        if old is not None and old.artifact_id == aid:
            new = merge_lease(old.expiry, expiry)
            self._index_key(tx, aid, key, old.expiry, new)
        else:
            new = expiry
            if old is not None:
                await self._move_off(tx, old, key)
            self._index_key(tx, aid, key, None, new)
        tx.put(self._k("k", key), codec.encode_binding(aid, new))
        tx.put(self._k("ka", aid, key), codec.encode_expiry(new))
        tx.delete(self._k("tk", key))

    async def _move_off(self, tx: Txn, old: codec.Binding, key: str) -> None:
        tx.delete(self._k("ka", old.artifact_id, key))
        self._index_key(tx, old.artifact_id, key, old.expiry, None)
        raw = await tx.get(self._k("a", old.artifact_id))
        if raw is not None:
            rec = codec.ARTIFACT.decode(raw)
            self._hold(tx, old.artifact_id, rec, old.expiry)
            tx.put(self._k("a", old.artifact_id), codec.ENC.encode(rec))

    def _replica_keys(self, aid: str, worker_id: str) -> list[bytes]:
        """The keys an artifact's replica bookkeeping reads (fetched together up front)."""
        return [self._k("a", aid), self._k("r", aid), self._k("t", aid), self._k("rw", worker_id, aid),
                self._k("dw", worker_id, aid)]

    async def _add_replicas(self, tx: Txn, aid: str, rec: codec.Artifact, worker_id: str, tiers: Sequence[str]) -> None:
        # The record is written even when unchanged: a delete racing with this commit then sees it changed.
        tx.put(self._k("a", aid), codec.ENC.encode(rec))
        have = set(await self._replicas(tx, aid))
        tx.put(self._k("r", aid), codec.ENC.encode(sorted(have | {(worker_id, t) for t in tiers})))
        raw = await tx.get(self._k("rw", worker_id, aid))
        mine = set(codec.TIERS.decode(raw)) if raw else set()
        tx.put(self._k("rw", worker_id, aid), codec.ENC.encode(sorted(mine | set(tiers))))
        tx.delete(self._k("dw", worker_id, aid))

    def _set_expiry(self, tx: Txn, aid: str, old: float | None, new: float | None) -> None:
        """The anonymous lease's index entry (``le/``)."""
        if old == new:
            return
        if old is not None:
            tx.delete(self._k("le", f"{old:020.6f}", aid))
        if new is not None:
            tx.put(self._k("le", f"{new:020.6f}", aid), b"")

    def _index_key(self, tx: Txn, aid: str, key: str, old: float | None, new: float | None) -> None:
        """A leased key binding's index entry (``kl/``)."""
        if old == new:
            return
        if old is not None:
            tx.delete(self._k("kl", f"{old:020.6f}", aid, key))
        if new is not None:
            tx.put(self._k("kl", f"{new:020.6f}", aid, key), b"")

    async def _deleted_here(self, tx: Txn, aid: str, worker_id: str) -> bool:
        return await tx.get(self._k("t", aid)) is not None or await tx.get(self._k("dw", worker_id, aid)) is not None

    async def prune_tombstones(self, before: float) -> int:
        n = 0
        for kind in ("t", "tk"):
            for kv in await self.etcd.prefix(self._k(kind, "")):
                if codec.TOMB.decode(kv.value).at < before:
                    async def decide(tx: Txn, key: bytes = kv.key, rev: int = kv.mod_revision) -> int:
                        raw = await tx.get(key)
                        if raw is None or codec.TOMB.decode(raw).at >= before:
                            return 0
                        tx.delete(key)
                        return 1

                    n += await self.etcd.atomically(decide)
        return n

    # ----------------------------------------------------------------- references
    async def set_lease(self, artifact_id: str, key: str | None, lease_expiry: float) -> bool:
        async def decide(tx: Txn) -> bool:
            raw = await tx.get(self._k("a", artifact_id))
            if raw is None:
                return False
            rec = codec.ARTIFACT.decode(raw)
            if key is None:
                if rec.anonymous is not True or rec.lease_expiry is None:
                    return False
                self._set_expiry(tx, artifact_id, rec.lease_expiry, lease_expiry)
                rec.lease_expiry = lease_expiry
            else:
                bound = await tx.get(self._k("k", key))
                b = codec.binding(bound) if bound is not None else None
                if b is None or b.artifact_id != artifact_id or b.expiry is None:
                    return False
                self._index_key(tx, artifact_id, key, b.expiry, lease_expiry)
                tx.put(self._k("k", key), codec.encode_binding(artifact_id, lease_expiry))
                tx.put(self._k("ka", artifact_id, key), codec.encode_expiry(lease_expiry))
            tx.put(self._k("a", artifact_id), codec.ENC.encode(rec))
            return True

        return await self.etcd.atomically(decide)

    async def unbind(self, artifact_id: str, key: str | None, now: float, reason: str,
                     expired_only: bool = False) -> Unbound | None:
        tomb = codec.Tomb(artifact_id, reason, now)

        async def decide(tx: Txn) -> Unbound | None:
            raw = await tx.get(self._k("a", artifact_id))
            if raw is None:
                return None
            rec = codec.ARTIFACT.decode(raw)
            bindings = await self._bindings(artifact_id)  # after the record (see the module docstring)
            refs = codec.references(rec, bindings)
            outcome = unbind_outcome(refs, key, now, expired_only)
            if outcome == "missing":
                return None
            if outcome == "delete":
                if len(bindings) > _KEY_BATCH:
                    raise _TooManyKeys
                return Unbound(True, tuple(await self._delete_writes(tx, artifact_id, rec, bindings, tomb)))
            if outcome == "kept":
                return Unbound(False, keys=refs.live_keys(now))
            if key is None:
                self._set_expiry(tx, artifact_id, rec.lease_expiry, None)
                rec.anonymous, rec.lease_expiry = False, None
            else:
                await self._unbind_keys(tx, artifact_id, ((key, refs.expiry(key)),), tomb)
            tx.put(self._k("a", artifact_id), codec.ENC.encode(rec))
            return Unbound(False, keys=refs.without(key).live_keys(now))

        while True:
            try:
                return await self.etcd.atomically(decide)
            except _TooManyKeys:  # the others are all expired: unbind a batch of them first
                expired = tuple((k, e) for k, e in await self._bindings(artifact_id) if k != key and not live(e, now))
                await self._unbind_batch(artifact_id, expired[:_KEY_BATCH], tomb, expired_at=now)

    async def _unbind_batch(self, aid: str, batch: Bindings, tomb: codec.Tomb, expired_at: float | None = None) -> None:
        async def decide(tx: Txn) -> None:
            await tx.get(self._k("a", aid))  # checked: a commit meanwhile makes this run again
            await self._unbind_keys(tx, aid, batch, tomb, expired_at)

        await self.etcd.atomically(decide)

    async def delete_artifact(self, artifact_id: str, now: float, reason: str = "deleted") -> list[str]:
        tomb = codec.Tomb(artifact_id, reason, now)
        # Keys beyond what fits in one transaction beside the record are unbound first, a batch per
        # transaction: a delete cut short leaves the artifact with fewer keys (deleting it again by id
        # finishes the job), never a key to nothing.
        while len(bindings := await self._bindings(artifact_id)) > _KEY_BATCH:
            await self._unbind_batch(artifact_id, bindings[:_KEY_BATCH], tomb)

        async def decide(tx: Txn) -> list[str]:
            raw = await tx.get(self._k("a", artifact_id))  # a concurrent commit rewrites it: this one retries
            # Read after the record: a key a commit added since is in this list, or the record moved and
            # this attempt fails its compare and runs again.
            bindings = await self._bindings(artifact_id)
            rec = codec.ARTIFACT.decode(raw) if raw else None
            return await self._delete_writes(tx, artifact_id, rec, bindings, tomb)

        return await self.etcd.atomically(decide)

    async def _delete_writes(self, tx: Txn, aid: str, rec: codec.Artifact | None, bindings: Bindings,
                             tomb: codec.Tomb) -> list[str]:
        holders = sorted({w for w, _ in await self._replicas(tx, aid)})
        tx.delete(self._k("a", aid))
        if rec is not None:
            self._set_expiry(tx, aid, rec.lease_expiry, None)
        await self._unbind_keys(tx, aid, bindings, tomb)
        for w in holders:
            tx.put(self._k("dw", w, aid), b"")
        tx.put(self._k("t", aid), codec.ENC.encode(tomb))
        return holders

    async def _unbind_keys(self, tx: Txn, aid: str, bindings: Bindings, tomb: codec.Tomb,
                           expired_at: float | None = None) -> None:
        """Remove ``bindings`` from the artifact, and tombstone those that still named it (1 check, up to 4
        writes each). ``expired_at``: only those whose lease had ended by then."""
        for k, _ in bindings:
            raw = await tx.get(self._k("k", k))
            b = codec.binding(raw) if raw is not None else None
            if b is not None and b.artifact_id == aid:
                if expired_at is not None and live(b.expiry, expired_at):
                    continue
                tx.delete(self._k("k", k))
                tx.put(self._k("tk", k), codec.ENC.encode(tomb))
                self._index_key(tx, aid, k, b.expiry, None)
            tx.delete(self._k("ka", aid, k))

    # ----------------------------------------------------------------- read leases (gs.read_leases)
    async def grant_read(self, artifact_id: str, worker_id: str, until: float) -> bool:
        async def decide(tx: Txn) -> bool:
            if await tx.get(self._k("a", artifact_id)) is None:  # a delete meanwhile fails the compare
                return False
            tx.put(self._k("rl", artifact_id, worker_id), repr(until).encode())
            return True

        return await self.etcd.atomically(decide)

    async def reads_of(self, artifact_id: str, now: float) -> list[tuple[str, float]]:
        base = self._k("rl", artifact_id, "")
        held = [(kv.key[len(base):].decode(), float(kv.value)) for kv in await self.etcd.prefix(base)]
        return [(w, until) for w, until in held if until > now]

    async def end_reads(self, artifact_id: str, leases: Sequence[tuple[str, float]]) -> None:
        async def ended(tx: Txn, batch: Sequence[tuple[str, float]]) -> None:
            for w, until in batch:
                key = self._k("rl", artifact_id, w)
                raw = await tx.get(key)  # a grant meanwhile changes it: this runs again and keeps it
                if raw is not None and float(raw) == until:
                    tx.delete(key)

        for i in range(0, len(leases), _KEY_BATCH):
            await self.etcd.atomically(functools.partial(ended, batch=leases[i : i + _KEY_BATCH]))

    # ----------------------------------------------------------------- records from before key references
    async def convert_legacy(self) -> int:
        """Convert every record written before keys were references (``gs.refs.legacy``: its keys inherit its
        ownership), once per store (a marker says it was done); returns how many. Safe while other global
        stores do the same: each step is a transaction on the record."""
        done = self._k("v", "references")
        if await self.etcd.get(done) is not None:
            return 0
        base, start, n = self._k("a", ""), self._k("a", ""), 0
        while True:
            kvs = (await self.etcd.range(start, prefix_end(base), _SCAN))[0]
            for kv in kvs:
                if codec.ARTIFACT.decode(bytes(kv.value)).anonymous is None:
                    await self._convert(kv.key[len(base):].decode())
                    n += 1
            if len(kvs) < _SCAN:
                break
            start = bytes(kvs[-1].key) + b"\0"
        await self.etcd.put(done, b"1")
        return n

    async def _convert(self, aid: str) -> None:
        async def decide(tx: Txn) -> bool:  # True when the record is converted (or gone)
            raw = await tx.get(self._k("a", aid))
            rec = codec.ARTIFACT.decode(raw) if raw is not None else None
            if raw is None or rec is None or rec.anonymous is not None:
                return True
            values = await self._key_values(aid)
            pending = [k for k, v in values if not v][:_KEY_BATCH]  # bindings still in the old form
            for k in pending:
                bound = await tx.get(self._k("k", k))
                if bound is not None and codec.binding(bound).artifact_id == aid:
                    tx.put(self._k("k", k), codec.encode_binding(aid, rec.lease_expiry))
                    self._index_key(tx, aid, k, None, rec.lease_expiry)
                    tx.put(self._k("ka", aid, k), codec.encode_expiry(rec.lease_expiry))
                else:
                    tx.delete(self._k("ka", aid, k))
            if not pending:
                if values:
                    self._set_expiry(tx, aid, rec.lease_expiry, None)
                    rec.lease_expiry = None
                rec.anonymous = not values
            tx.put(self._k("a", aid), codec.ENC.encode(rec))
            return not pending

        while not await self.etcd.atomically(decide):
            pass

    # ----------------------------------------------------------------- replicas
    async def add_replica(self, artifact_id: str, worker_id: str, tiers: tuple[str, ...],
                          restored: bool = False) -> bool:
        async def decide(tx: Txn) -> bool:
            await tx.prefetch(self._replica_keys(artifact_id, worker_id))
            raw = await tx.get(self._k("a", artifact_id))
            if raw is None:
                return False
            if restored and await self._deleted_here(tx, artifact_id, worker_id):
                return False
            await self._add_replicas(tx, artifact_id, codec.ARTIFACT.decode(raw), worker_id, tiers)
            return True

        return await self.etcd.atomically(decide)

    async def remove_replica(self, artifact_id: str, worker_id: str, tier: str) -> bool:
        return await self._remove_tiers(artifact_id, worker_id, {tier})

    async def _remove_tiers(self, aid: str, worker_id: str, tiers: set[str] | None) -> bool:
        async def decide(tx: Txn) -> bool:
            await tx.prefetch(self._replica_keys(aid, worker_id))
            return await self._drop_replicas(tx, aid, worker_id, tiers)

        return await self.etcd.atomically(decide)

    async def _drop_replicas(self, tx: Txn, aid: str, worker_id: str, tiers: set[str] | None) -> bool:
        """Forget ``worker_id``'s replicas of ``aid`` in ``tiers`` (all when None); True when the artifact is
        still recorded and has no replica left."""
        raw = await tx.get(self._k("rw", worker_id, aid))
        mine = set(codec.TIERS.decode(raw)) if raw else set()
        left = set() if tiers is None else mine - tiers
        if left:
            tx.put(self._k("rw", worker_id, aid), codec.ENC.encode(sorted(left)))
        elif raw is not None:
            tx.delete(self._k("rw", worker_id, aid))
        replicas = await self._replicas(tx, aid)
        keep = [(w, t) for w, t in replicas if not (w == worker_id and (tiers is None or t in tiers))]
        if keep != replicas:
            if keep:
                tx.put(self._k("r", aid), codec.ENC.encode(keep))
            else:
                tx.delete(self._k("r", aid))
        return not keep and await tx.get(self._k("a", aid)) is not None
