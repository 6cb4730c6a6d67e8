"""The SQLite backend's schema, and the migration of databases created by earlier versions.

Owns: the tables and indexes (``SCHEMA``) and ``migrate`` (columns added since a database was created, all
with defaults). Does not own: the statements that read and write them (``gs.sqlite``).

References (``gs.refs``): ``keys.expiry`` is a key binding's lease (NULL: permanent); ``artifacts.anonymous``
says whether puts without a key hold the artifact, ``artifacts.lease_expiry`` is that reference's lease (NULL:
a system hold). A database from before references held one ownership per artifact in ``lease_expiry``: its
keys inherit it, and only an artifact without keys keeps it as its anonymous reference (``gs.refs.legacy``).
"""

from __future__ import annotations

import sqlite3

__all__ = ["SCHEMA", "migrate"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS workers (
    worker_id TEXT PRIMARY KEY,
    address TEXT NOT NULL,
    host_id TEXT NOT NULL,
    roles TEXT NOT NULL,
    pid INTEGER NOT NULL,
    incarnation INTEGER NOT NULL,
    registered_at REAL NOT NULL,
    last_heartbeat REAL NOT NULL,
    memory_used INTEGER NOT NULL DEFAULT 0,
    memory_capacity INTEGER NOT NULL DEFAULT 0,
    artifacts INTEGER NOT NULL DEFAULT 0,
    data_address TEXT NOT NULL DEFAULT '',
    disk_used INTEGER NOT NULL DEFAULT 0,
    disk_capacity INTEGER NOT NULL DEFAULT 0,
    net_in_bps REAL NOT NULL DEFAULT 0,
    net_out_bps REAL NOT NULL DEFAULT 0,
    transfers_in_flight INTEGER NOT NULL DEFAULT 0,
    memory_prefaulted INTEGER NOT NULL DEFAULT 0,
    metrics_url TEXT NOT NULL DEFAULT '',
    kv_events_url TEXT NOT NULL DEFAULT '',
    kv_events_replay_url TEXT NOT NULL DEFAULT '',
    plans_in_flight INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS artifacts (
    artifact_id TEXT PRIMARY KEY,
    tensors BLOB NOT NULL,
    nbytes INTEGER NOT NULL,
    created_at REAL NOT NULL,
    lease_expiry REAL,
    policy TEXT NOT NULL DEFAULT 'cache',
    meta TEXT NOT NULL DEFAULT '{}',
    anonymous INTEGER NOT NULL DEFAULT 1
);
CREATE INDEX IF NOT EXISTS artifacts_lease ON artifacts(lease_expiry) WHERE lease_expiry IS NOT NULL;
CREATE TABLE IF NOT EXISTS keys (
    key TEXT PRIMARY KEY,
    artifact_id TEXT NOT NULL,
    expiry REAL
);
CREATE INDEX IF NOT EXISTS keys_artifact ON keys(artifact_id);
CREATE TABLE IF NOT EXISTS replicas (
    artifact_id TEXT NOT NULL,
    worker_id TEXT NOT NULL,
    tier TEXT NOT NULL,
    PRIMARY KEY (artifact_id, worker_id, tier)
);
CREATE INDEX IF NOT EXISTS replicas_worker ON replicas(worker_id);
CREATE TABLE IF NOT EXISTS instances (
    instance_id TEXT PRIMARY KEY,
    info BLOB NOT NULL,
    last_heartbeat REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS shard_leases (
    shard INTEGER PRIMARY KEY,
    holder TEXT NOT NULL,
    token INTEGER NOT NULL,
    expiry REAL NOT NULL,
    acquired_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS page_index (
    key TEXT PRIMARY KEY,
    worker_id TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS drops (
    artifact_id TEXT NOT NULL,
    worker_id TEXT NOT NULL,
    PRIMARY KEY (artifact_id, worker_id)
);
CREATE TABLE IF NOT EXISTS read_leases (
    artifact_id TEXT NOT NULL,
    worker_id TEXT NOT NULL,
    until REAL NOT NULL,
    PRIMARY KEY (artifact_id, worker_id)
);
CREATE TABLE IF NOT EXISTS tombstones (
    artifact_id TEXT PRIMARY KEY,
    reason TEXT NOT NULL,
    at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS tombstones_at ON tombstones(at);
CREATE TABLE IF NOT EXISTS key_tombstones (
    key TEXT PRIMARY KEY,
    artifact_id TEXT NOT NULL,
    reason TEXT NOT NULL,
    at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS key_tombstones_at ON key_tombstones(at);
"""

# Created after ``migrate``: they index columns an older database gains there.
_INDEXES = ("CREATE INDEX IF NOT EXISTS keys_expiry ON keys(expiry) WHERE expiry IS NOT NULL",)


def _columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in db.execute(f"PRAGMA table_info({table})")}


def migrate(db: sqlite3.Connection) -> None:
    """Bring a database created by an earlier version up to ``SCHEMA``, in one transaction."""
    db.execute("BEGIN IMMEDIATE")
    try:
        have = _columns(db, "workers")
        for column, decl in (("memory_prefaulted", "INTEGER NOT NULL DEFAULT 0"),
                             ("metrics_url", "TEXT NOT NULL DEFAULT ''"),
                             ("plans_in_flight", "INTEGER NOT NULL DEFAULT 0"),
                             ("kv_events_url", "TEXT NOT NULL DEFAULT ''"),
                             ("kv_events_replay_url", "TEXT NOT NULL DEFAULT ''")):
            if column not in have:
                db.execute(f"ALTER TABLE workers ADD COLUMN {column} {decl}")
        if "expiry" not in _columns(db, "keys"):
            db.execute("ALTER TABLE keys ADD COLUMN expiry REAL")
            db.execute("UPDATE keys SET expiry=(SELECT lease_expiry FROM artifacts "
                       "WHERE artifacts.artifact_id=keys.artifact_id)")
        if "anonymous" not in _columns(db, "artifacts"):
            db.execute("ALTER TABLE artifacts ADD COLUMN anonymous INTEGER NOT NULL DEFAULT 1")
            db.execute("UPDATE artifacts SET anonymous=0, lease_expiry=NULL "
                       "WHERE artifact_id IN (SELECT artifact_id FROM keys)")
        for statement in _INDEXES:
            db.execute(statement)
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise
