"""etcd backend of the global store: the metadata on a replicated (Raft) engine, served by any number of
global-store processes at once.

Owns: the key layout under ``gs.etcd_prefix`` and every operation of ``MetadataBackend`` as etcd
transactions (optimistic: read, decide, commit only if nothing read changed). Liveness is an etcd lease:
a worker's or instance's heartbeat key lives under a lease of ``gs.worker_liveness_timeout`` that each
heartbeat refreshes, so a process that stops heartbeating disappears from etcd by itself, whichever
global store it talked to. Shard leases change by compare-and-swap per shard (the fencing token is bumped
in the same transaction); the lease table is kept in memory from an etcd watch, so listing it reads no
keys. The artifact operations are ``gs.etcd_artifacts`` (its reads ``gs.etcd_reads``). Does not own: the
rules (``gs.refs``, ``kv.leases``), the RPC surface (``gs.service``) or the client (``gs.etcd_client``).

Layout (``P`` = the prefix)::

    P w/{worker}          worker record (its latest registration) and the id of its etcd lease
    P hb/{worker}         heartbeat stats, under the worker's etcd lease
    P i/{instance}        instance record;  P ih/{instance}  its load, under the instance's etcd lease
    P a/{artifact}        artifact record (with its anonymous reference: a hold, a lease, or none);
    P g/{artifact}        the copies it wants, when more than one (gs.etcd_goals)
    P r/{artifact}        its replicas [(worker, tier)] (kept after a delete until every holder dropped it)
    P k/{key}             key -> (artifact, binding's expiry);  P ka/{artifact}/{key}  the artifact's keys
                          (value: the binding's expiry, so one range reads all of an artifact's references)
    P rw/{worker}/{art}   the tiers of a worker's replicas (what a restart removes)
    P dw/{worker}/{art}   a drop the worker owes
    P le/{expiry}/{art}   anonymous caller leases by expiry;  P kl/{expiry}/{art}/{key}  leased key bindings
                          by expiry (the reaper's range scans)
    P rl/{art}/{worker}   the end of a gateway's read lease on the artifact (gs.read_leases)
    P t/{art}, tk/{key}   tombstones;  P s/{shard}  shard leases;  P pi/{key}  the page-index benchmark
    P gsp/{address}       a live global-store process (its metrics URL), under its own etcd lease
    P v/references        set once records from before key references were converted
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import msgspec

from tensorcast.gs import etcd_records as codec
from tensorcast.gs.etcd_artifacts import EtcdArtifacts
from tensorcast.gs.etcd_client import EtcdClient, PrefixMirror, Txn
from tensorcast.kv.leases import LeaseRecord
from tensorcast.records import InstanceInfo, WorkerInfo, WorkerLoad

__all__ = ["EtcdBackend"]

log = logging.getLogger("tensorcast.gs.etcd")


# Operations per transaction kept well under etcd's 128 (each shard costs a compare and a put).
_LEASE_BATCH = 60


class EtcdBackend(EtcdArtifacts):
    def __init__(self, endpoints: str | list[str], prefix: str = "/tensorcast/", liveness_ttl: float = 5.0) -> None:
        self.etcd = EtcdClient(endpoints)
        self.p = prefix.encode()
        self.liveness_ttl = liveness_ttl
        # What every request reads, followed by watches instead of read per request: shard leases, workers
        # and their heartbeats, instances and theirs.
        self._mirrors = {name: PrefixMirror(self.etcd, self._k(name, "")) for name in ("s", "w", "hb", "i", "ih")}
        self._store_leases: dict[str, int] = {}  # this process's announcements: address -> etcd lease

    async def open(self) -> None:
        await self.etcd.open()
        for mirror in self._mirrors.values():
            await mirror.start()
        if converted := await self.convert_legacy():
            log.info("converted %d artifact records from before key references", converted)

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
            incarnation = (codec.WORKER.decode(raw).info.incarnation if raw else 0) + 1
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

    async def heartbeat(self, worker_id: str, incarnation: int, load: WorkerLoad, now: float,
                        dropped: tuple[str, ...]) -> tuple[bool, tuple[str, ...]]:
        raw = await self.etcd.get(self._k("w", worker_id))
        if raw is None:
            return False, ()
        rec = codec.WORKER.decode(raw)
        if rec.info.incarnation != incarnation:
            return False, ()
        lease = rec.lease
        if not await self.etcd.keepalive(lease):  # expired while the worker was silent: a fresh one
            lease = await self.etcd.grant(self.liveness_ttl)

            async def relink(tx: Txn) -> bool:
                cur = await tx.get(self._k("w", worker_id))
                if cur is None or codec.WORKER.decode(cur).info.incarnation != incarnation:
                    return False
                tx.put(self._k("w", worker_id), codec.ENC.encode(codec.Worker(rec.info, lease)))
                return True

            if not await self.etcd.atomically(relink):
                return False, ()
        beat = codec.ENC.encode({**msgspec.structs.asdict(load), "last_heartbeat": now})
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
        return codec.with_stats(codec.WORKER.decode(rec[1]).info, codec.STATS.decode(beat[1]) if beat else None)

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
        lease = codec.INSTANCE_RECORD.decode(raw).lease
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
                       msgspec.structs.replace(codec.INSTANCE_RECORD.decode(value).info, last_heartbeat=0.0))
        return out

    # ----------------------------------------------------------------- shard leases
    async def load_leases(self) -> dict[int, LeaseRecord]:
        return {int(key): LeaseRecord(int(key), *msgspec.structs.astuple(codec.LEASE.decode(value)))
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
            cur = None if raw is None else LeaseRecord(s, *msgspec.structs.astuple(codec.LEASE.decode(raw)))
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
