"""SQLite backend of the global store: the embedded default.

Owns: the SQL (the schema and its migration are in ``gs.sqlite_schema``). WAL journal, one writer (the GS
event loop), ``synchronous`` from config (FULL by default: every commit is on disk before the service
acknowledges). Each public method is one transaction. Does not own: the reference rules (``gs.refs``) or
the RPC surface.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec

from tensorcast import clock
from tensorcast.errors import InvalidArgument, ResourceExhausted
from tensorcast.gs import sqlite_goals
from tensorcast.gs.backend import ArtifactRow, GoalRow, MetadataBackend, Unbound
from tensorcast.gs.refs import References, list_cursor, merge_lease, parse_cursor, unbind_outcome
from tensorcast.gs.sqlite_schema import SCHEMA, migrate
from tensorcast.kv.leases import LeaseRecord
from tensorcast.records import ArtifactInfo, InstanceInfo, TensorMeta, WorkerInfo, WorkerLoad

__all__ = ["SqliteBackend"]


# The workers table: identity columns, then one per WorkerLoad field (same names).
_WORKER_COLUMNS = ("worker_id", "address", "host_id", "roles", "pid", "incarnation", "registered_at", "last_heartbeat",
                   "data_address", "metrics_url", *WorkerLoad.__struct_fields__)
_WORKER_SELECT = ", ".join(_WORKER_COLUMNS)
_HEARTBEAT_SQL = (f"UPDATE workers SET last_heartbeat=?, {', '.join(f'{f}=?' for f in WorkerLoad.__struct_fields__)} "
                  "WHERE worker_id=? AND incarnation=?")
_TENSORS = msgspec.msgpack.Encoder()
_TENSORS_DEC = msgspec.msgpack.Decoder(tuple[TensorMeta, ...])
_ENC = msgspec.msgpack.Encoder()
_INSTANCE = msgspec.msgpack.Decoder(InstanceInfo)


class SqliteBackend(MetadataBackend):
    def __init__(self, path: str | Path, synchronous: str = "FULL", max_bytes: int = 0) -> None:
        if synchronous.upper() not in {"OFF", "NORMAL", "FULL", "EXTRA"}:
            raise InvalidArgument(f"gs.sqlite_synchronous must be OFF/NORMAL/FULL/EXTRA, got {synchronous!r}")
        self.path = Path(path)
        self.synchronous = synchronous.upper()
        self.max_bytes = max_bytes  # 0: as large as the disk allows
        self._db: sqlite3.Connection | None = None
        self._stores: dict[str, tuple[str, float]] = {}  # the global store using this file (address -> url)

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError("backend not opened")
        return self._db

    async def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={self.synchronous}")
        if self.max_bytes:  # a database at this size fails its writes as a full disk would (SQLITE_FULL)
            page = self._db.execute("PRAGMA page_size").fetchone()[0]
            self._db.execute(f"PRAGMA max_page_count={max(1, self.max_bytes // page)}")
        self._db.executescript(SCHEMA)
        self._db.executescript(sqlite_goals.SCHEMA)
        migrate(self._db)

    async def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    async def check(self) -> None:
        self.db.execute("SELECT 1").fetchone()

    @contextlib.contextmanager
    def _tx(self, durable: bool = True) -> Iterator[sqlite3.Connection]:
        """One write transaction: committed when the block ends (``return`` included), rolled back if it
        raises, so a failed statement never leaves the connection inside a transaction.

        ``durable=False`` is for state that a power loss makes moot anyway: heartbeats, the locations of
        *memory* replicas and the records of artifacts held only in memory (which do not survive a power loss
        either; restarted workers re-register and their memory replicas are cleared). Those commits survive a
        crash of this process (WAL) without waiting for an fsync; everything else waits for the configured
        ``synchronous`` level."""
        db = self.db
        relaxed = not durable and self.synchronous in ("FULL", "EXTRA")
        if relaxed:
            db.execute("PRAGMA synchronous=NORMAL")
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:  # SQLite may already have rolled back (a full disk, for one)
                    db.execute("ROLLBACK")
                raise
        except sqlite3.OperationalError as exc:
            if not _full(exc):
                raise
            # A full disk (or gs.sqlite_max_bytes reached) is the operator's to fix, not a bug: typed and
            # retryable, nothing of the transaction kept, and reads go on being served.
            raise ResourceExhausted(f"the global store's database {self.path.name} is full: {exc}") from None
        finally:
            if relaxed:
                db.execute(f"PRAGMA synchronous={self.synchronous}")

    # ----------------------------------------------------------------- workers
    async def register_worker(self, worker: WorkerInfo, now: float) -> tuple[int, list[str]]:
        with self._tx() as db:
            row = db.execute("SELECT incarnation FROM workers WHERE worker_id=?", (worker.worker_id,)).fetchone()
            incarnation = (row[0] if row else 0) + 1
            db.execute(
                f"INSERT OR REPLACE INTO workers ({_WORKER_SELECT}) VALUES ({', '.join('?' * len(_WORKER_COLUMNS))})",
                (worker.worker_id, worker.address, worker.host_id, json.dumps(list(worker.roles)), worker.pid,
                 incarnation, now, now, worker.data_address, worker.metrics_url,
                 *msgspec.structs.astuple(worker.load)),
            )
            lost = [r[0] for r in db.execute(
                "SELECT artifact_id FROM replicas WHERE worker_id=? AND tier='memory'", (worker.worker_id,))]
            db.execute("DELETE FROM replicas WHERE worker_id=? AND tier='memory'", (worker.worker_id,))
            # Pending drops stay: a holder that was down when an artifact was deleted must still drop it.
            orphans = [aid for aid in lost if self._unreplicated(db, aid)]
        return incarnation, orphans

    @staticmethod
    def _unreplicated(db: sqlite3.Connection, artifact_id: str) -> bool:
        """The artifact exists and no replica of it is recorded any more."""
        return db.execute("SELECT 1 FROM artifacts WHERE artifact_id=?", (artifact_id,)).fetchone() is not None \
            and db.execute("SELECT 1 FROM replicas WHERE artifact_id=? LIMIT 1", (artifact_id,)).fetchone() is None

    async def heartbeat(self, worker_id: str, incarnation: int, load: WorkerLoad, now: float,
                        dropped: tuple[str, ...]) -> tuple[bool, tuple[str, ...]]:
        with self._tx(durable=False) as db:
            cur = db.execute(_HEARTBEAT_SQL, (now, *msgspec.structs.astuple(load), worker_id, incarnation))
            if cur.rowcount == 0:
                return False, ()
            for aid in dropped:
                # Only an outstanding drop removes the replica: the artifact may have been put again since.
                gone = db.execute("DELETE FROM drops WHERE artifact_id=? AND worker_id=?", (aid, worker_id))
                if gone.rowcount:
                    db.execute("DELETE FROM replicas WHERE artifact_id=? AND worker_id=?", (aid, worker_id))
            todo = tuple(r[0] for r in db.execute("SELECT artifact_id FROM drops WHERE worker_id=?", (worker_id,)))
        return True, todo

    @staticmethod
    def _worker(row: tuple[Any, ...]) -> WorkerInfo:
        fields = dict(zip(_WORKER_COLUMNS, row, strict=True))
        return WorkerInfo(**{**fields, "roles": tuple(json.loads(fields["roles"]))})

    async def list_workers(self) -> list[WorkerInfo]:
        return [self._worker(r) for r in self.db.execute(f"SELECT {_WORKER_SELECT} FROM workers ORDER BY worker_id")]

    async def get_worker(self, worker_id: str) -> WorkerInfo | None:
        row = self.db.execute(f"SELECT {_WORKER_SELECT} FROM workers WHERE worker_id=?", (worker_id,)).fetchone()
        return None if row is None else self._worker(row)

    # ----------------------------------------------------------------- instances
    async def upsert_instance(self, info: InstanceInfo, now: float) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO instances VALUES (?,?,?)", (info.instance_id, _ENC.encode(info), now))

    async def instance_heartbeat(self, instance_id: str, load: dict[str, int], now: float) -> bool:
        row = self.db.execute("SELECT info FROM instances WHERE instance_id=?", (instance_id,)).fetchone()
        if row is None:
            return False
        info = msgspec.structs.replace(_INSTANCE.decode(row[0]), **load)
        with self._tx(durable=False) as db:
            db.execute("UPDATE instances SET info=?, last_heartbeat=? WHERE instance_id=?",
                       (_ENC.encode(info), now, instance_id))
        return True

    async def list_instances(self) -> list[InstanceInfo]:
        return [msgspec.structs.replace(_INSTANCE.decode(r[0]), last_heartbeat=r[1])
                for r in self.db.execute("SELECT info, last_heartbeat FROM instances ORDER BY instance_id")]

    # ----------------------------------------------------------------- shard leases
    async def load_leases(self) -> dict[int, LeaseRecord]:
        return {r[0]: LeaseRecord(*r) for r in self.db.execute(
            "SELECT shard, holder, token, expiry, acquired_at FROM shard_leases")}

    async def update_leases(self, shards: Sequence[int],
                            change: Callable[[int, LeaseRecord | None], LeaseRecord | None]) -> list[LeaseRecord]:
        out = []
        with self._tx() as db:  # BEGIN IMMEDIATE: the only writer while it runs
            for s in shards:
                row = db.execute("SELECT shard, holder, token, expiry, acquired_at FROM shard_leases WHERE shard=?",
                                 (s,)).fetchone()
                cur = None if row is None else LeaseRecord(*row)
                new = change(s, cur)
                if new is not None and new != cur:
                    db.execute("INSERT OR REPLACE INTO shard_leases VALUES (?,?,?,?,?)",
                               (new.shard, new.holder, new.token, new.expiry, new.acquired_at))
                    out.append(new)
        return out

    async def announce_store(self, address: str, metrics_url: str, ttl: float) -> None:
        self._stores[address] = (metrics_url, clock.time() + ttl)  # one process: nothing to persist

    async def list_stores(self, now: float) -> dict[str, str]:
        return {a: url for a, (url, until) in self._stores.items() if until > now}

    async def page_index_put(self, keys: tuple[str, ...], worker_id: str) -> None:
        with self._tx(durable=False) as db:
            db.executemany("INSERT OR REPLACE INTO page_index VALUES (?,?)", [(k, worker_id) for k in keys])

    async def page_index_get(self, keys: tuple[str, ...]) -> list[str]:
        out = []
        for k in keys:
            row = self.db.execute("SELECT worker_id FROM page_index WHERE key=?", (k,)).fetchone()
            out.append(row[0] if row else "")
        return out

    # ----------------------------------------------------------------- artifacts
    async def commit_artifact(self, info: ArtifactInfo, worker_id: str, key: str | None,
                              lease_expiry: float | None, now: float, tiers: tuple[str, ...] = ("memory",),
                              restored: bool = False) -> bool:
        # An artifact held in memory only is gone after a power loss whether or not its record survives, so
        # its commit need not wait for an fsync (it still survives a crash of this process) -- unless it
        # rebinds a key in use, which a lost commit would silently point back at the older artifact.
        durable = set(tiers) != {"memory"} or (key is not None and self.db.execute(
            "SELECT 1 FROM keys WHERE key=?", (key,)).fetchone() is not None)
        with self._tx(durable=durable) as db:
            row = db.execute("SELECT anonymous, lease_expiry FROM artifacts WHERE artifact_id=?",
                             (info.id,)).fetchone()
            if restored and self._deleted_here(db, info.id, worker_id):
                return False
            db.execute("DELETE FROM tombstones WHERE artifact_id=?", (info.id,))
            if row is None:
                db.execute("INSERT INTO artifacts (artifact_id, tensors, nbytes, created_at, lease_expiry, policy, "
                           "meta, anonymous) VALUES (?,?,?,?,?,?,?,?)",
                           (info.id, _TENSORS.encode(info.tensors), info.nbytes, now,
                            lease_expiry if key is None else None, info.policy, json.dumps(info.meta),
                            int(key is None)))
            elif key is None:
                self._hold(db, info.id, row, lease_expiry)
            sqlite_goals.note(db, info.id, info.replicas_wanted, new=row is None)
            if key is not None:
                self._bind(db, key, info.id, lease_expiry, now)
            for tier in tiers:
                db.execute("INSERT OR IGNORE INTO replicas VALUES (?,?,?)", (info.id, worker_id, tier))
            db.execute("DELETE FROM drops WHERE artifact_id=? AND worker_id=?", (info.id, worker_id))
        return True

    @staticmethod
    def _hold(db: sqlite3.Connection, artifact_id: str, row: tuple[int, float | None], expiry: float | None) -> None:
        """Merge ``expiry`` onto the anonymous reference (``row``: its anonymous, lease_expiry)."""
        lease = merge_lease(row[1] if row[0] else False, expiry)
        db.execute("UPDATE artifacts SET anonymous=1, lease_expiry=? WHERE artifact_id=?", (lease, artifact_id))

    def _bind(self, db: sqlite3.Connection, key: str, artifact_id: str, expiry: float | None, now: float) -> None:
        """Bind ``key`` (merged onto its binding to this artifact; moved from another one, which keeps what
        the key held as its anonymous reference)."""
        old = db.execute("SELECT artifact_id, expiry FROM keys WHERE key=?", (key,)).fetchone()
        if old is not None and old[0] == artifact_id:
            expiry = merge_lease(old[1], expiry)
        elif old is not None:
            moved = db.execute("SELECT anonymous, lease_expiry FROM artifacts WHERE artifact_id=?",
                               (old[0],)).fetchone()
            if moved is not None:
                self._hold(db, old[0], moved, old[1])
        db.execute("INSERT OR REPLACE INTO keys (key, artifact_id, expiry) VALUES (?,?,?)", (key, artifact_id, expiry))
        db.execute("DELETE FROM key_tombstones WHERE key=?", (key,))

    @staticmethod
    def _deleted_here(db: sqlite3.Connection, artifact_id: str, worker_id: str) -> bool:
        """The artifact was deleted (tombstone), or this worker still owes a drop of it."""
        return db.execute("SELECT 1 FROM tombstones WHERE artifact_id=?", (artifact_id,)).fetchone() is not None \
            or db.execute("SELECT 1 FROM drops WHERE artifact_id=? AND worker_id=?",
                          (artifact_id, worker_id)).fetchone() is not None

    async def resolve_key(self, key: str) -> tuple[str, float | None] | None:
        row = self.db.execute("SELECT artifact_id, expiry FROM keys WHERE key=?", (key,)).fetchone()
        return None if row is None else (str(row[0]), row[1])

    @staticmethod
    def _refs(db: sqlite3.Connection, artifact_id: str, row: tuple[Any, ...]) -> References:
        bindings = tuple((str(k), e) for k, e in db.execute(
            "SELECT key, expiry FROM keys WHERE artifact_id=? ORDER BY key", (artifact_id,)))
        return References(bindings, bool(row[0]), row[1] if row[0] else None)

    async def get_artifact(self, artifact_id: str) -> ArtifactRow | None:
        row = self.db.execute(
            "SELECT anonymous, lease_expiry, tensors, nbytes, created_at, policy, meta FROM artifacts "
            "WHERE artifact_id=?", (artifact_id,)).fetchone()
        if row is None:
            return None
        info = ArtifactInfo(id=artifact_id, tensors=_TENSORS_DEC.decode(row[2]), nbytes=row[3], created_at=row[4],
                            policy=row[5], meta=json.loads(row[6]),
                            replicas_wanted=sqlite_goals.goal(self.db, artifact_id))
        return ArtifactRow(info, self._refs(self.db, artifact_id, row))

    async def replica_goals(self, holder: str, after: str, limit: int) -> tuple[list[GoalRow], str]:
        return sqlite_goals.rows(self.db, holder, after, limit)

    async def replicas_of(self, artifact_id: str) -> list[tuple[str, str]]:
        return [(r[0], r[1]) for r in self.db.execute(
            "SELECT worker_id, tier FROM replicas WHERE artifact_id=? ORDER BY worker_id", (artifact_id,))]

    async def list_artifacts(self, prefix: str, limit: int, after: str, now: float
                             ) -> tuple[list[tuple[str | None, str]], str]:
        kind, mark = parse_cursor(after)
        out: list[tuple[str | None, str]] = []
        if kind != "a":
            # Range scan on the key index: [prefix, prefix + U+10FFFF), after the cursor (the last key seen).
            bound = " AND key < ?" if prefix else ""
            out += self.db.execute(
                f"SELECT key, artifact_id FROM keys WHERE key >= ? AND key > ?{bound} "
                "AND (expiry IS NULL OR expiry > ?) ORDER BY key LIMIT ?",
                (prefix, mark, *((prefix + "\U0010ffff",) if prefix else ()), now, limit)).fetchall()
            if len(out) == limit:
                return out, list_cursor(str(out[-1][0]), out[-1][1])
            if prefix:
                return out, ""
            mark = ""
        out += [(None, r[0]) for r in self.db.execute(
            "SELECT artifact_id FROM artifacts WHERE artifact_id > ? AND NOT EXISTS "
            "(SELECT 1 FROM keys WHERE keys.artifact_id=artifacts.artifact_id) ORDER BY artifact_id LIMIT ?",
            (mark, limit - len(out)))]
        return out, list_cursor(None, out[-1][1]) if len(out) == limit else ""

    async def key_sizes(self, limit: int) -> tuple[list[tuple[str, int]], int]:
        pairs = self.db.execute("SELECT keys.key, artifacts.nbytes FROM keys JOIN artifacts USING (artifact_id) "
                                "ORDER BY keys.key LIMIT ?", (limit,)).fetchall()
        total = self.db.execute("SELECT COUNT(*) FROM artifacts").fetchone()[0]
        return [(k, n) for k, n in pairs], total

    async def set_lease(self, artifact_id: str, key: str | None, lease_expiry: float) -> bool:
        with self._tx() as db:
            if key is None:
                cur = db.execute("UPDATE artifacts SET lease_expiry=? WHERE artifact_id=? AND anonymous=1 "
                                 "AND lease_expiry IS NOT NULL", (lease_expiry, artifact_id))
            else:
                cur = db.execute("UPDATE keys SET expiry=? WHERE key=? AND artifact_id=? AND expiry IS NOT NULL",
                                 (lease_expiry, key, artifact_id))
        return cur.rowcount > 0

    async def unbind(self, artifact_id: str, key: str | None, now: float, reason: str,
                     expired_only: bool = False) -> Unbound | None:
        with self._tx() as db:
            row = db.execute("SELECT anonymous, lease_expiry FROM artifacts WHERE artifact_id=?",
                             (artifact_id,)).fetchone()
            if row is None:
                return None
            refs = self._refs(db, artifact_id, row)
            outcome = unbind_outcome(refs, key, now, expired_only)
            if outcome == "missing":
                return None
            if outcome == "delete":
                return Unbound(True, tuple(self._delete(db, artifact_id, now, reason)))
            if outcome == "unbind":
                if key is None:
                    db.execute("UPDATE artifacts SET anonymous=0, lease_expiry=NULL WHERE artifact_id=?",
                               (artifact_id,))
                else:
                    db.execute("DELETE FROM keys WHERE key=?", (key,))
                    db.execute("INSERT OR REPLACE INTO key_tombstones VALUES (?,?,?,?)",
                               (key, artifact_id, reason, now))
                refs = refs.without(key)
            return Unbound(False, keys=refs.live_keys(now))

    async def delete_artifact(self, artifact_id: str, now: float, reason: str = "deleted") -> list[str]:
        with self._tx() as db:
            return self._delete(db, artifact_id, now, reason)

    @staticmethod
    def _delete(db: sqlite3.Connection, artifact_id: str, now: float, reason: str) -> list[str]:
        holders = [r[0] for r in db.execute(
            "SELECT DISTINCT worker_id FROM replicas WHERE artifact_id=?", (artifact_id,))]
        keys = [r[0] for r in db.execute("SELECT key FROM keys WHERE artifact_id=?", (artifact_id,))]
        db.execute("DELETE FROM artifacts WHERE artifact_id=?", (artifact_id,))
        db.execute("DELETE FROM keys WHERE artifact_id=?", (artifact_id,))
        for wid in holders:
            db.execute("INSERT OR IGNORE INTO drops VALUES (?,?)", (artifact_id, wid))
        db.execute("INSERT OR REPLACE INTO tombstones VALUES (?,?,?)", (artifact_id, reason, now))
        db.executemany("INSERT OR REPLACE INTO key_tombstones VALUES (?,?,?,?)",
                       [(k, artifact_id, reason, now) for k in keys])
        return holders

    async def tombstone(self, key_or_id: str) -> tuple[str, str] | None:
        row = self.db.execute("SELECT artifact_id, reason FROM tombstones WHERE artifact_id=?", (key_or_id,)).fetchone()
        if row is None:
            row = self.db.execute("SELECT artifact_id, reason FROM key_tombstones WHERE key=?", (key_or_id,)).fetchone()
        return None if row is None else (str(row[0]), str(row[1]))

    async def prune_tombstones(self, before: float) -> int:
        with self._tx(durable=False) as db:
            n = db.execute("DELETE FROM tombstones WHERE at < ?", (before,)).rowcount
            n += db.execute("DELETE FROM key_tombstones WHERE at < ?", (before,)).rowcount
        return n

    async def expired_references(self, now: float) -> list[tuple[str, str | None]]:
        keys = [(str(r[0]), str(r[1])) for r in self.db.execute(
            "SELECT artifact_id, key FROM keys WHERE expiry IS NOT NULL AND expiry <= ?", (now,))]
        anonymous: list[tuple[str, str | None]] = [(str(r[0]), None) for r in self.db.execute(
            "SELECT artifact_id FROM artifacts WHERE lease_expiry IS NOT NULL AND lease_expiry <= ? AND anonymous=1",
            (now,))]
        return [*keys, *anonymous]

    async def add_replica(self, artifact_id: str, worker_id: str, tiers: tuple[str, ...],
                          restored: bool = False) -> bool:
        with self._tx(durable=set(tiers) != {"memory"}) as db:
            if db.execute("SELECT 1 FROM artifacts WHERE artifact_id=?", (artifact_id,)).fetchone() is None:
                return False
            if restored and self._deleted_here(db, artifact_id, worker_id):
                return False  # put again while this holder was down, but its copy was to be dropped
            for tier in tiers:
                db.execute("INSERT OR IGNORE INTO replicas VALUES (?,?,?)", (artifact_id, worker_id, tier))
            db.execute("DELETE FROM drops WHERE artifact_id=? AND worker_id=?", (artifact_id, worker_id))
        return True

    async def remove_replica(self, artifact_id: str, worker_id: str, tier: str) -> bool:
        with self._tx(durable=tier != "memory") as db:
            db.execute("DELETE FROM replicas WHERE artifact_id=? AND worker_id=? AND tier=?",
                       (artifact_id, worker_id, tier))
            return self._unreplicated(db, artifact_id)


def _full(exc: sqlite3.OperationalError) -> bool:
    """SQLITE_FULL: the disk, or the database's size cap, has no room for the write."""
    return getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "full" in str(exc)
