"""SQLite backend of the global store: how many copies each artifact wants (``gs.sqlite``'s replica goals).

Owns: the ``replica_goals`` table (a row only for an artifact wanting more than one copy; a put asking for more
raises it, the first put of an id, after a delete too, sets it) and its SQL. Does not own: the transaction
(the caller's), liveness (``gs.service``) or what is done about a short artifact (``worker.replication``).
"""

from __future__ import annotations

import sqlite3

from tensorcast.gs.backend import GoalRow

__all__ = ["SCHEMA", "goal", "note", "rows"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS replica_goals (
    artifact_id TEXT PRIMARY KEY,
    replicas INTEGER NOT NULL
);
"""


def note(db: sqlite3.Connection, artifact_id: str, wanted: int, new: bool) -> None:
    """(Inside the commit's transaction.) Record a put's wanted copies; ``new``: the artifact's first record,
    so a row left by a deleted artifact of that id goes."""
    if new:
        db.execute("DELETE FROM replica_goals WHERE artifact_id=?", (artifact_id,))
    if wanted > 1:
        db.execute("INSERT INTO replica_goals VALUES (?,?) ON CONFLICT(artifact_id) DO UPDATE SET "
                   "replicas=MAX(replicas, excluded.replicas)", (artifact_id, wanted))


def goal(db: sqlite3.Connection, artifact_id: str) -> int:
    row = db.execute("SELECT replicas FROM replica_goals WHERE artifact_id=?", (artifact_id,)).fetchone()
    return 1 if row is None else int(row[0])


def rows(db: sqlite3.Connection, holder: str, after: str, limit: int) -> tuple[list[GoalRow], str]:
    """One page of (artifact id, wanted copies, its replicas) of recorded artifacts wanting more than one copy
    (with a replica on ``holder`` only, when it is given), by id after ``after``; and the next cursor."""
    if holder:
        found = db.execute("SELECT g.artifact_id, g.replicas FROM replica_goals g JOIN artifacts USING (artifact_id) "
                           "WHERE g.artifact_id > ? AND EXISTS (SELECT 1 FROM replicas r WHERE r.artifact_id = "
                           "g.artifact_id AND r.worker_id = ?) ORDER BY g.artifact_id LIMIT ?",
                           (after, holder, limit)).fetchall()
    else:
        found = db.execute("SELECT g.artifact_id, g.replicas FROM replica_goals g JOIN artifacts USING (artifact_id) "
                           "WHERE g.artifact_id > ? ORDER BY g.artifact_id LIMIT ?", (after, limit)).fetchall()
    out = [(aid, int(n), [(str(w), str(t)) for w, t in db.execute(
        "SELECT worker_id, tier FROM replicas WHERE artifact_id=? ORDER BY worker_id", (aid,))]) for aid, n in found]
    return out, found[-1][0] if len(found) == limit else ""
