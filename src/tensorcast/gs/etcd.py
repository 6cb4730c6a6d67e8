"""etcd backend of the global store: the metadata on a replicated (Raft) engine, served by any number of
global-store processes at once.

Owns: the key layout under ``gs.etcd_prefix`` and every operation of ``MetadataBackend`` as etcd
transactions (optimistic: read, decide, commit only if nothing read changed). Liveness is an etcd lease:
a worker's or instance's heartbeat key lives under a lease of ``gs.worker_liveness_timeout`` that each
heartbeat refreshes, so a process that stops heartbeating disappears from etcd by itself, whichever
global store it talked to. Shard leases change by compare-and-swap per shard (the fencing token is bumped
in the same transaction); the lease table is kept in memory from an etcd watch, so listing it reads no
keys. Does not own: the rules (``gs.backend``, ``kv.leases``), the RPC surface (``gs.service``) or the
client (``gs.etcd_client``).

Layout (``P`` = the prefix)::

    P w/{worker}          worker record (its latest registration) and the id of its etcd lease
    P hb/{worker}         heartbeat stats, under the worker's etcd lease
    P i/{instance}        instance record;  P ih/{instance}  its load, under the instance's etcd lease
    P a/{artifact}        artifact record
    P r/{artifact}        its replicas [(worker, tier)] (kept after a delete until every holder dropped it)
    P k/{key}             key -> artifact;  P ka/{artifact}/{key}  the artifact's keys
    P rw/{worker}/{art}   the tiers of a worker's replicas (what a restart removes)
    P dw/{worker}/{art}   a drop the worker owes
    P le/{expiry}/{art}   caller-leased artifacts by expiry (the reaper's range scan)
    P t/{art}, tk/{key}   tombstones;  P s/{shard}  shard leases;  P pi/{key}  the page-index benchmark
    P gsp/{address}       a live global-store process (its metrics URL), under its own etcd lease
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import msgspec

from tensorcast.gs import etcd_records as codec
from tensorcast.gs.backend import ArtifactRow, MetadataBackend, merge_lease
from tensorcast.gs.etcd_client import EtcdClient, PrefixMirror, Txn, prefix_end
from tensorcast.kv.leases import LeaseRecord
from tensorcast.records import ArtifactInfo, InstanceInfo, WorkerInfo

__all__ = ["EtcdBackend"]

log = logging.getLogger("tensorcast.gs.etcd")


# Operations per transaction kept well under etcd's 128 (each shard costs a compare and a put).
_LEASE_BATCH = 60
# Keys unbound per transaction when an artifact is deleted (4 operations each), leaving room for the rest.
_KEY_BATCH = 24


class EtcdBackend(MetadataBackend):
    def __init__(self, endpoints: str | list[str], prefix: str = "/tensorcast/", liveness_ttl: float = 5.0) -> None:
        self.etcd = EtcdClient(endpoints)
        self.p = prefix.encode()
        self.liveness_ttl = liveness_ttl
        # What every request reads, followed by watches instead of read per request: shard leases, workers
        # and their heartbeats, instances and theirs.
        self._mirrors = {name: PrefixMirror(self.etcd, self._k(name, "")) for name in ("s", "w", "hb", "i", "ih")}
        self._store_leases: dict[str, int] = {}  # this process's announcements: address -> etcd lease

    def _k(self, *parts: str) -> bytes:
        return self.p + "/".join(parts).encode()

    async def open(self) -> None:
        await self.etcd.open()
        for mirror in self._mirrors.values():
            await mirror.start()

    async def close(self) -> None:
        for mirror in self._mirrors.values():
            await mirror.close()
        await self.etcd.close()

    async def check(self) -> None:
        await self.etcd.ping()

    def _noted(self, revision: int, writes: dict[tuple[str, str], bytes | None]) -> None:
        """This process's own writes to mirrored prefixes, seen at once."""
        for (name, key), value in writes.items():
            self._mirrors[name].note(key.encode(), revision, value)

    # ----------------------------------------------------------------- workers
    async def register_worker(self, worker: WorkerInfo, now: float) -> tuple[int, list[str]]:
        lease = await self.etcd.grant(self.liveness_ttl)

        wid = worker.worker_id
        written: dict[tuple[str, str], bytes | None] = {}

        async def decide(tx: Txn) -> int:
            raw = await tx.get(self._k("w", wid))
            incarnation = (codec.W.decode(raw).info.incarnation if raw else 0) + 1
            info = msgspec.structs.replace(worker, incarnation=incarnation, registered_at=now, last_heartbeat=now)
            record, beat = codec.ENC.encode(codec.Worker(info, lease)), codec.ENC.encode({"last_heartbeat": now})
            written.update({("w", wid): record, ("hb", wid): beat})
            tx.put(self._k("w", wid), record)
            tx.put(self._k("hb", wid), beat, lease)
            return incarnation

        incarnation = await self.etcd.atomically(decide)
        self._noted(self.etcd.last_revision, written)
        # Memory does not survive a restart: its memory replicas go (pending drops stay).
        orphans = []
        for kv in await self.etcd.prefix(self._k("rw", worker.worker_id, "")):
            aid = kv.key[len(self._k("rw", worker.worker_id, "")):].decode()
            if "memory" in codec.TIERS.decode(kv.value) and await self._remove_tiers(aid, worker.worker_id, {"memory"}):
                orphans.append(aid)
        return incarnation, orphans

    async def heartbeat(self, worker_id: str, incarnation: int, stats: dict[str, float], now: float,
                        dropped: tuple[str, ...]) -> tuple[bool, tuple[str, ...]]:
        raw = await self.etcd.get(self._k("w", worker_id))
        if raw is None:
            return False, ()
        rec = codec.W.decode(raw)
        if rec.info.incarnation != incarnation:
            return False, ()
        lease = rec.lease
        if not await self.etcd.keepalive(lease):  # expired while the worker was silent: a fresh one
            lease = await self.etcd.grant(self.liveness_ttl)

            async def relink(tx: Txn) -> bool:
                cur = await tx.get(self._k("w", worker_id))
                if cur is None or codec.W.decode(cur).info.incarnation != incarnation:
                    return False
                tx.put(self._k("w", worker_id), codec.ENC.encode(codec.Worker(rec.info, lease)))
                return True

            if not await self.etcd.atomically(relink):
                return False, ()
        beat = codec.ENC.encode({**stats, "last_heartbeat": now})
        self._noted(await self.etcd.put(self._k("hb", worker_id), beat, lease), {("hb", worker_id): beat})
        for aid in dropped:
            await self._acknowledge_drop(aid, worker_id)
        todo = tuple(kv.key[len(self._k("dw", worker_id, "")):].decode()
                     for kv in await self.etcd.prefix(self._k("dw", worker_id, "")))
        return True, todo

    async def _acknowledge_drop(self, aid: str, worker_id: str) -> None:
        """Only an outstanding drop removes the replica: the artifact may have been put again since."""
        async def decide(tx: Txn) -> None:
            if await tx.get(self._k("dw", worker_id, aid)) is None:
                return
            tx.delete(self._k("dw", worker_id, aid))
            await self._drop_replicas(tx, aid, worker_id, None)

        await self.etcd.atomically(decide)

    async def list_workers(self) -> list[WorkerInfo]:
        return [w for key in sorted(self._mirrors["w"].items) if (w := self._worker(key)) is not None]

    async def get_worker(self, worker_id: str) -> WorkerInfo | None:
        return self._worker(worker_id.encode())

    def _worker(self, key: bytes) -> WorkerInfo | None:
        """A worker's record with its latest heartbeat, as this process follows them."""
        rec = self._mirrors["w"].items.get(key)
        if rec is None:
            return None
        beat = self._mirrors["hb"].items.get(key)
        return codec.with_stats(codec.W.decode(rec[1]).info, codec.STATS.decode(beat[1]) if beat else None)

    # ----------------------------------------------------------------- instances
    async def upsert_instance(self, info: InstanceInfo, now: float) -> None:
        lease = await self.etcd.grant(self.liveness_ttl)
        rec = msgspec.structs.replace(info, last_heartbeat=now)
        iid = info.instance_id
        record, beat = codec.ENC.encode(codec.Instance(rec, lease)), codec.ENC.encode(rec)
        self._noted(await self.etcd.put(self._k("i", iid), record), {("i", iid): record})
        self._noted(await self.etcd.put(self._k("ih", iid), beat, lease), {("ih", iid): beat})

    async def instance_heartbeat(self, instance_id: str, load: dict[str, int], now: float) -> bool:
        raw = await self.etcd.get(self._k("i", instance_id))
        if raw is None:
            return False
        lease = codec.IR.decode(raw).lease
        beat = await self.etcd.get(self._k("ih", instance_id))
        if beat is None or not await self.etcd.keepalive(lease):
            return False  # its liveness lease expired: it registers again
        info = msgspec.structs.replace(codec.INSTANCE.decode(beat), **load, last_heartbeat=now)
        value = codec.ENC.encode(info)
        self._noted(await self.etcd.put(self._k("ih", instance_id), value, lease), {("ih", instance_id): value})
        return True

    async def list_instances(self) -> list[InstanceInfo]:
        beats = self._mirrors["ih"].items
        out = []
        for key, (_rev, value) in sorted(self._mirrors["i"].items.items()):
            beat = beats.get(key)
            # Its liveness lease expired: listed as registered, with no recent heartbeat (not alive).
            out.append(codec.INSTANCE.decode(beat[1]) if beat else
                       msgspec.structs.replace(codec.IR.decode(value).info, last_heartbeat=0.0))
        return out

    # ----------------------------------------------------------------- shard leases
    async def load_leases(self) -> dict[int, LeaseRecord]:
        return {int(key): LeaseRecord(int(key), *msgspec.structs.astuple(codec.L.decode(value)))
                for key, (_rev, value) in self._mirrors["s"].items.items()}

    async def update_leases(self, shards: Sequence[int],
                            change: Callable[[int, LeaseRecord | None], LeaseRecord | None]) -> list[LeaseRecord]:
        changed: list[LeaseRecord] = []
        for i in range(0, len(shards), _LEASE_BATCH):
            batch = shards[i:i + _LEASE_BATCH]

            async def decide(tx: Txn, batch: Sequence[int] = batch) -> list[LeaseRecord]:
                await tx.prefetch([self._shard_key(s) for s in batch])
                return await self._cas(tx, batch, change)

            # First try on the table this process follows (one round trip when it is current).
            followed = self._mirrors["s"].items
            known = {self._shard_key(s): followed[f"{s:06d}".encode()] for s in batch
                     if f"{s:06d}".encode() in followed}
            done = await self.etcd.atomically(decide, known=known)
            self._noted(self.etcd.last_revision, {("s", f"{r.shard:06d}"): codec.encode_lease(r) for r in done})
            changed += done
        return changed

    def _shard_key(self, shard: int) -> bytes:
        return self._k("s", f"{shard:06d}")

    async def _cas(self, tx: Txn, shards: Sequence[int],
                   change: Callable[[int, LeaseRecord | None], LeaseRecord | None]) -> list[LeaseRecord]:
        out = []
        for s in shards:
            raw = await tx.get(self._shard_key(s))
            cur = None if raw is None else LeaseRecord(s, *msgspec.structs.astuple(codec.L.decode(raw)))
            new = change(s, cur)
            if new is not None and new != cur:
                tx.put(self._shard_key(s), codec.encode_lease(new))
                out.append(new)
        return out

    async def announce_store(self, address: str, metrics_url: str, ttl: float) -> None:
        lease = self._store_leases.get(address, 0)
        if not lease or not await self.etcd.keepalive(lease):
            lease = self._store_leases[address] = await self.etcd.grant(ttl)
        await self.etcd.put(self._k("gsp", address), metrics_url.encode(), lease)

    async def list_stores(self, now: float) -> dict[str, str]:
        base = self._k("gsp", "")
        return {kv.key[len(base):].decode(): kv.value.decode() for kv in await self.etcd.prefix(base)}

    async def page_index_put(self, keys: tuple[str, ...], worker_id: str) -> None:
        for k in keys:
            await self.etcd.put(self._k("pi", k), worker_id.encode())

    async def page_index_get(self, keys: tuple[str, ...]) -> list[str]:
        return [(await self.etcd.get(self._k("pi", k)) or b"").decode() for k in keys]

    # ----------------------------------------------------------------- artifacts
    async def commit_artifact(self, info: ArtifactInfo, worker_id: str, key: str | None,
                              lease_expiry: float | None, now: float, tiers: tuple[str, ...] = ("memory",),
                              restored: bool = False) -> bool:
        async def decide(tx: Txn) -> bool:
            await tx.prefetch(self._replica_keys(info.id, worker_id) +
                              ([self._k("k", key)] if key is not None else []))  # one round trip for all reads
            raw = await tx.get(self._k("a", info.id))
            if restored and await self._deleted_here(tx, info.id, worker_id):
                return False
            tx.delete(self._k("t", info.id))
            cur = codec.A.decode(raw) if raw else None
            lease = merge_lease(False if cur is None else cur.lease_expiry, lease_expiry)
            rec = cur or codec.Artifact(info.tensors, info.nbytes, now, lease, info.policy, dict(info.meta))
            self._set_expiry(tx, info.id, rec.lease_expiry, lease)
            rec.lease_expiry = lease
            if key is not None:
                old = await tx.get(self._k("k", key))
                if old is not None and old.decode() != info.id:
                    tx.delete(self._k("ka", old.decode(), key))
                tx.put(self._k("k", key), info.id.encode())
                tx.put(self._k("ka", info.id, key), b"")
                tx.delete(self._k("tk", key))
            await self._add_replicas(tx, info.id, rec, worker_id, tiers)
            return True

        return await self.etcd.atomically(decide)

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
        if old == new:
            return
        if old is not None:
            tx.delete(self._k("le", f"{old:020.6f}", aid))
        if new is not None:
            tx.put(self._k("le", f"{new:020.6f}", aid), b"")

    async def _deleted_here(self, tx: Txn, aid: str, worker_id: str) -> bool:
        return await tx.get(self._k("t", aid)) is not None or await tx.get(self._k("dw", worker_id, aid)) is not None

    async def resolve_key(self, key: str) -> str | None:
        raw = await self.etcd.get(self._k("k", key))
        return None if raw is None else raw.decode()

    async def get_artifact(self, artifact_id: str) -> ArtifactRow | None:
        raw = await self.etcd.get(self._k("a", artifact_id))
        if raw is None:
            return None
        rec = codec.A.decode(raw)
        info = ArtifactInfo(id=artifact_id, tensors=rec.tensors, nbytes=rec.nbytes, created_at=rec.created_at,
                            policy=rec.policy, meta=rec.meta)
        return ArtifactRow(info, rec.lease_expiry)

    async def keys_of(self, artifact_id: str) -> tuple[str, ...]:
        base = self._k("ka", artifact_id, "")
        return tuple(kv.key[len(base):].decode() for kv in await self.etcd.prefix(base))

    async def _replicas(self, tx: Txn, aid: str) -> list[tuple[str, str]]:
        raw = await tx.get(self._k("r", aid))
        return [] if raw is None else codec.REPLICAS.decode(raw)

    async def replicas_of(self, artifact_id: str) -> list[tuple[str, str]]:
        raw = await self.etcd.get(self._k("r", artifact_id))
        return [] if raw is None else sorted(codec.REPLICAS.decode(raw))

    async def list_artifacts(self, prefix: str, limit: int, after: str = "") -> tuple[list[str], str]:
        if not prefix:
            base = self._k("a", "")
            start = base + after.encode() + b"\0" if after else base
            kvs = (await self.etcd.range(start, prefix_end(base), limit, keys_only=True))[0]
            ids = [kv.key[len(base):].decode() for kv in kvs]
            return ids, ids[-1] if len(ids) == limit else ""
        base = self._k("k", "")
        start = base + max(prefix, after + "\0" if after else "").encode()
        kvs = (await self.etcd.range(start, prefix_end(base + prefix.encode()), limit))[0]
        ids = list(dict.fromkeys(kv.value.decode() for kv in kvs))
        return ids, kvs[-1].key[len(base):].decode() if len(kvs) == limit else ""

    async def key_sizes(self, limit: int) -> tuple[list[tuple[str, int]], int]:
        total = (await self.etcd.range(self._k("a", ""), prefix_end(self._k("a", "")), count_only=True))[1]
        if limit <= 0:
            return [], total
        base = self._k("k", "")
        out = []
        for kv in (await self.etcd.range(base, prefix_end(base), limit))[0]:
            raw = await self.etcd.get(self._k("a", kv.value.decode()))
            if raw is not None:
                out.append((kv.key[len(base):].decode(), codec.A.decode(raw).nbytes))
        return out, total

    async def set_lease(self, artifact_id: str, lease_expiry: float | None) -> bool:
        async def decide(tx: Txn) -> bool:
            raw = await tx.get(self._k("a", artifact_id))
            if raw is None:
                return False
            rec = codec.A.decode(raw)
            self._set_expiry(tx, artifact_id, rec.lease_expiry, lease_expiry)
            rec.lease_expiry = lease_expiry
            tx.put(self._k("a", artifact_id), codec.ENC.encode(rec))
            return True

        return await self.etcd.atomically(decide)

    async def delete_artifact(self, artifact_id: str, now: float, reason: str = "deleted") -> list[str]:
        tomb = codec.Tomb(artifact_id, reason, now)
        # Keys beyond what fits in one transaction beside the record are unbound first, a batch per
        # transaction: a delete cut short leaves the artifact with fewer keys (deleting it again by id
        # finishes the job), never a key to nothing.
        while len(keys := await self.keys_of(artifact_id)) > _KEY_BATCH:

            async def unbind(tx: Txn, batch: tuple[str, ...] = keys[:_KEY_BATCH]) -> None:
                await self._unbind_keys(tx, artifact_id, batch, tomb)

            await self.etcd.atomically(unbind)

        async def decide(tx: Txn) -> list[str]:
            raw = await tx.get(self._k("a", artifact_id))  # a concurrent commit rewrites it: this one retries
            rec = codec.A.decode(raw) if raw else None
            # Read after the record: a key a commit added since is in this list, or the record moved and
            # this attempt fails its compare and runs again.
            keys = await self.keys_of(artifact_id)
            holders = sorted({w for w, _ in await self._replicas(tx, artifact_id)})
            tx.delete(self._k("a", artifact_id))
            if rec is not None:
                self._set_expiry(tx, artifact_id, rec.lease_expiry, None)
            await self._unbind_keys(tx, artifact_id, keys, tomb)
            for w in holders:
                tx.put(self._k("dw", w, artifact_id), b"")
            tx.put(self._k("t", artifact_id), codec.ENC.encode(tomb))
            return holders

        return await self.etcd.atomically(decide)

    async def _unbind_keys(self, tx: Txn, artifact_id: str, keys: tuple[str, ...], tomb: codec.Tomb) -> None:
        """Remove ``keys`` from the artifact, and tombstone those that still named it (1 check, 3 writes each)."""
        for k in keys:
            if (await tx.get(self._k("k", k)) or b"").decode() == artifact_id:
                tx.delete(self._k("k", k))
                tx.put(self._k("tk", k), codec.ENC.encode(tomb))
            tx.delete(self._k("ka", artifact_id, k))

    async def tombstone(self, key_or_id: str) -> tuple[str, str] | None:
        raw = await self.etcd.get(self._k("t", key_or_id)) or await self.etcd.get(self._k("tk", key_or_id))
        if raw is None:
            return None
        t = codec.T.decode(raw)
        return t.artifact_id, t.reason

    async def prune_tombstones(self, before: float) -> int:
        n = 0
        for kind in ("t", "tk"):
            for kv in await self.etcd.prefix(self._k(kind, "")):
                if codec.T.decode(kv.value).at < before:
                    async def decide(tx: Txn, key: bytes = kv.key, rev: int = kv.mod_revision) -> int:
                        raw = await tx.get(key)
                        if raw is None or codec.T.decode(raw).at >= before:
                            return 0
                        tx.delete(key)
                        return 1

                    n += await self.etcd.atomically(decide)
        return n

    async def expired_artifacts(self, now: float) -> list[str]:
        base = self._k("le", "")
        kvs = (await self.etcd.range(base, self._k("le", f"{now:020.6f}", "\xff")))[0]
        return list(dict.fromkeys(kv.key[len(base) + 21:].decode() for kv in kvs))

    async def add_replica(self, artifact_id: str, worker_id: str, tiers: tuple[str, ...],
                          restored: bool = False) -> bool:
        async def decide(tx: Txn) -> bool:
            await tx.prefetch(self._replica_keys(artifact_id, worker_id))
            raw = await tx.get(self._k("a", artifact_id))
            if raw is None:
                return False
            if restored and await self._deleted_here(tx, artifact_id, worker_id):
                return False
            await self._add_replicas(tx, artifact_id, codec.A.decode(raw), worker_id, tiers)
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

