"""The SQLite backend's artifacts: records, references (key bindings, the anonymous hold or lease), replicas,
pending drops and tombstones, as SQL. ``gs.sqlite`` composes this with the rest.

Owns: the artifact operations of ``MetadataBackend`` on the tables of ``gs.sqlite_schema``, each one
transaction, and which of them may commit without waiting for an fsync (those about memory replicas only,
which a power loss makes moot anyway, unless they rebind a key in use). Does not own: the connection and its
transactions (``gs.sqlite``), the reference rules (``gs.refs``), the copies wanted (``gs.sqlite_goals``),
workers, instances or shard leases (``gs.sqlite``).
"""

from __future__ import annotations

import abc
import contextlib
import json
import sqlite3
from collections.abc import Sequence
from typing import Any

import msgspec

from tensorcast.gs import sqlite_goals
from tensorcast.gs.backend import ArtifactCommit, ArtifactRow, GoalRow, MetadataBackend, Unbound
from tensorcast.gs.refs import References, list_cursor, merge_lease, parse_cursor, unbind_outcome
from tensorcast.records import ArtifactInfo, TensorMeta

__all__ = ["SqliteArtifacts"]

_TENSORS = msgspec.msgpack.Encoder()
_TENSORS_DEC = msgspec.msgpack.Decoder(tuple[TensorMeta, ...])


class SqliteArtifacts(MetadataBackend):
    @property
    @abc.abstractmethod
    def db(self) -> sqlite3.Connection:
        """The open connection."""

    @abc.abstractmethod
    def _tx(self, durable: bool = True) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        """One write transaction (``gs.sqlite``)."""

    async def commit_artifact(self, info: ArtifactInfo, worker_id: str, key: str | None,
                              lease_expiry: float | None, now: float, tiers: tuple[str, ...] = ("memory",),
                              restored: bool = False) -> bool:
        commit = ArtifactCommit(info, worker_id, key, lease_expiry, tiers, restored)
        with self._tx(durable=self._durable(commit)) as db:
            return self._commit(db, commit, now)

    async def commit_artifacts(self, commits: Sequence[ArtifactCommit], now: float) -> list[bool]:
        """One transaction for the group, which waits for an fsync once if any commit needs one."""
        with self._tx(durable=any(self._durable(c) for c in commits)) as db:
            return [self._commit(db, c, now) for c in commits]

    def _durable(self, c: ArtifactCommit) -> bool:
        # An artifact held in memory only is gone after a power loss whether or not its record survives, so
        # its commit need not wait for an fsync (it still survives a crash of this process) -- unless it
        # rebinds a key in use, which a lost commit would silently point back at the older artifact.
        return set(c.tiers) != {"memory"} or (c.key is not None and self.db.execute(
            "SELECT 1 FROM keys WHERE key=?", (c.key,)).fetchone() is not None)

    def _commit(self, db: sqlite3.Connection, c: ArtifactCommit, now: float) -> bool:
        info, key = c.info, c.key
        row = db.execute("SELECT anonymous, lease_expiry FROM artifacts WHERE artifact_id=?", (info.id,)).fetchone()
        if c.restored and self._deleted_here(db, info.id, c.worker_id):
            return False
        db.execute("DELETE FROM tombstones WHERE artifact_id=?", (info.id,))
        if row is None:
            db.execute("INSERT INTO artifacts (artifact_id, tensors, nbytes, created_at, lease_expiry, policy, "
                       "meta, anonymous) VALUES (?,?,?,?,?,?,?,?)",
                       (info.id, _TENSORS.encode(info.tensors), info.nbytes, now,
                        c.lease_expiry if key is None else None, info.policy, json.dumps(info.meta),
                        int(key is None)))
        elif key is None:
            self._hold(db, info.id, row, c.lease_expiry)
        sqlite_goals.note(db, info.id, info.replicas_wanted, new=row is None)
        if key is not None:
            self._bind(db, key, info.id, c.lease_expiry, now)
        for tier in c.tiers:
            db.execute("INSERT OR IGNORE INTO replicas VALUES (?,?,?)", (info.id, c.worker_id, tier))
        db.execute("DELETE FROM drops WHERE artifact_id=? AND worker_id=?", (info.id, c.worker_id))
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

    async def grant_read(self, artifact_id: str, worker_id: str, until: float) -> bool:
        # Not waiting for an fsync: a lease outlives a crash of this process (the WAL keeps it); after a power
        # loss the store could forget one, and its holder answer a deleted id until it ends.
        with self._tx(durable=False) as db:
            if db.execute("SELECT 1 FROM artifacts WHERE artifact_id=?", (artifact_id,)).fetchone() is None:
                return False
            db.execute("INSERT OR REPLACE INTO read_leases VALUES (?,?,?)", (artifact_id, worker_id, until))
        return True

    async def reads_of(self, artifact_id: str, now: float) -> list[tuple[str, float]]:
        return [(str(r[0]), float(r[1])) for r in self.db.execute(
            "SELECT worker_id, until FROM read_leases WHERE artifact_id=? AND until > ?", (artifact_id, now))]

    async def end_reads(self, artifact_id: str, leases: Sequence[tuple[str, float]]) -> None:
        with self._tx(durable=False) as db:
            db.executemany("DELETE FROM read_leases WHERE artifact_id=? AND worker_id=? AND until=?",
                           [(artifact_id, w, until) for w, until in leases])

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

    @staticmethod
    def _unreplicated(db: sqlite3.Connection, artifact_id: str) -> bool:
        """The artifact exists and no replica of it is recorded any more."""
        return db.execute("SELECT 1 FROM artifacts WHERE artifact_id=?", (artifact_id,)).fetchone() is not None \
            and db.execute("SELECT 1 FROM replicas WHERE artifact_id=? LIMIT 1", (artifact_id,)).fetchone() is None
