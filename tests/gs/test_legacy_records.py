"""Metadata written before keys were references, read by today's backends: each key inherits the ownership
its artifact had, an artifact without keys keeps it as its anonymous reference, so deleting every key of an
old artifact still deletes it (what deleting any key did then)."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import msgspec

from tensorcast.gs.backend import MetadataBackend, Unbound
from tensorcast.gs.etcd import EtcdBackend
from tensorcast.gs.etcd_client import EtcdClient
from tensorcast.gs.refs import References
from tensorcast.gs.sqlite import SqliteBackend
from tensorcast.records import TensorMeta
from tensorcast.testing.etcd import EtcdCluster

A, B, C = "tc-" + "a" * 32, "tc-" + "b" * 32, "tc-" + "c" * 32
TENSORS = (TensorMeta(name="t", dtype="uint8", shape=(4,), nbytes=4, digest="0" * 64),)


async def _check(b: MetadataBackend) -> None:
    """A: keys "a1", "a2", leased until 50; B: no key, system-owned; C: key "c", system-owned."""
    assert (await b.get_artifact(A)).refs == References((("a1", 50.0), ("a2", 50.0)))  # type: ignore[union-attr]
    assert (await b.get_artifact(B)).refs == References(anonymous=True)  # type: ignore[union-attr]
    assert (await b.get_artifact(C)).refs == References((("c", None),))  # type: ignore[union-attr]
    assert await b.resolve_key("a1") == (A, 50.0) and await b.resolve_key("c") == (C, None)
    assert sorted(await b.expired_references(60.0)) == [(A, "a1"), (A, "a2")]
    assert (await b.list_artifacts("", 10, "", 1.0))[0] == [("a1", A), ("a2", A), ("c", C), (None, B)]
    assert await b.unbind(C, "c", 2.0, "deleted") == Unbound(True)
    assert await b.unbind(A, "a1", 2.0, "deleted") == Unbound(False, keys=("a2",))


def test_an_old_sqlite_database_is_migrated(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "gs.sqlite3", isolation_level=None)
    db.executescript("""
        CREATE TABLE artifacts (artifact_id TEXT PRIMARY KEY, tensors BLOB NOT NULL, nbytes INTEGER NOT NULL,
            created_at REAL NOT NULL, lease_expiry REAL, policy TEXT NOT NULL DEFAULT 'cache',
            meta TEXT NOT NULL DEFAULT '{}');
        CREATE TABLE keys (key TEXT PRIMARY KEY, artifact_id TEXT NOT NULL);
    """)
    blob = msgspec.msgpack.encode(TENSORS)
    for aid, lease in ((A, 50.0), (B, None), (C, None)):
        db.execute("INSERT INTO artifacts VALUES (?,?,?,?,?,?,?)", (aid, blob, 4, 1.0, lease, "cache", "{}"))
    db.executemany("INSERT INTO keys VALUES (?,?)", [("a1", A), ("a2", A), ("c", C)])
    db.close()

    async def go() -> None:
        b = SqliteBackend(tmp_path / "gs.sqlite3")
        await b.open()
        try:
            await _check(b)
        finally:
            await b.close()
        again = SqliteBackend(tmp_path / "gs.sqlite3")  # migrated once: opening again changes nothing
        await again.open()
        try:
            assert (await again.get_artifact(A)).refs == References((("a2", 50.0),))  # type: ignore[union-attr]
        finally:
            await again.close()

    asyncio.run(go())


class _OldArtifact(msgspec.Struct, array_like=True):
    tensors: tuple[TensorMeta, ...]
    nbytes: int
    created_at: float
    lease_expiry: float | None
    policy: str
    meta: dict[str, str]


def test_old_etcd_records_are_converted(etcd_cluster: EtcdCluster, tmp_path: Path) -> None:
    prefix = f"/legacy/{tmp_path.name}/"

    async def go() -> None:
        etcd = EtcdClient(etcd_cluster.endpoints)
        await etcd.open()
        try:
            enc = msgspec.msgpack.Encoder()
            for aid, lease in ((A, 50.0), (B, None), (C, None)):
                await etcd.put(f"{prefix}a/{aid}".encode(), enc.encode(_OldArtifact(TENSORS, 4, 1.0, lease, "c", {})))
                if lease is not None:
                    await etcd.put(f"{prefix}le/{lease:020.6f}/{aid}".encode(), b"")
            for key, aid in (("a1", A), ("a2", A), ("c", C)):
                await etcd.put(f"{prefix}k/{key}".encode(), aid.encode())
                await etcd.put(f"{prefix}ka/{aid}/{key}".encode(), b"")
        finally:
            await etcd.close()
        b = EtcdBackend(etcd_cluster.endpoints, prefix=prefix)
        await b.open()
        try:
            await _check(b)
            assert await b.convert_legacy() == 0  # done once, for every global store on this etcd
        finally:
            await b.close()

    asyncio.run(go())
