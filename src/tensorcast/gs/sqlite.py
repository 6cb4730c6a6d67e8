"""SQLite backend of the global store: the embedded default.

Owns: the connection and its transactions (``_tx``), and the SQL of workers, instances, shard leases and
global-store processes (the schema and its migration are in ``gs.sqlite_schema``). WAL journal, one writer
(the GS event loop), ``synchronous`` from config (FULL by default: every commit is on disk before the service
acknowledges). Each public method is one transaction. Does not own: the artifacts' SQL
(``gs.sqlite_artifacts``), the reference rules (``gs.refs``) or the RPC surface.
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
from tensorcast.gs.sqlite_artifacts import SqliteArtifacts
from tensorcast.gs.sqlite_schema import SCHEMA, migrate
from tensorcast.kv.leases import LeaseRecord
from tensorcast.records import InstanceInfo, WorkerInfo, WorkerLoad

__all__ = ["SqliteBackend"]


# The workers table: identity columns, then one per WorkerLoad field (same names).
_WORKER_COLUMNS = ("worker_id", "address", "host_id", "roles", "pid", "incarnation", "registered_at", "last_heartbeat",
                   "data_address", "metrics_url", "kv_events_url", "kv_events_replay_url",
                   *WorkerLoad.__struct_fields__)
_WORKER_SELECT = ", ".join(_WORKER_COLUMNS)
_HEARTBEAT_SQL = (f"UPDATE workers SET last_heartbeat=?, {', '.join(f'{f}=?' for f in WorkerLoad.__struct_fields__)} "
                  "WHERE worker_id=? AND incarnation=?")
_ENC = msgspec.msgpack.Encoder()
_INSTANCE = msgspec.msgpack.Decoder(InstanceInfo)


class SqliteBackend(SqliteArtifacts):
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
                 incarnation, now, now, worker.data_address, worker.metrics_url, worker.kv_events_url,
                 worker.kv_events_replay_url,
                 *msgspec.structs.astuple(worker.load)),
            )
            lost = [r[0] for r in db.execute(
                "SELECT artifact_id FROM replicas WHERE worker_id=? AND tier='memory'", (worker.worker_id,))]
            db.execute("DELETE FROM replicas WHERE worker_id=? AND tier='memory'", (worker.worker_id,))
            # Pending drops stay: a holder that was down when an artifact was deleted must still drop it.
            orphans = [aid for aid in lost if self._unreplicated(db, aid)]
        return incarnation, orphans

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


def _full(exc: sqlite3.OperationalError) -> bool:
    """SQLITE_FULL: the disk, or the database's size cap, has no room for the write."""
    return getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "full" in str(exc)
