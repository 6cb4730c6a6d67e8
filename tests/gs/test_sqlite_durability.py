"""Which SQLite commits wait for an fsync: everything a power loss would not make moot anyway. A memory-only
artifact's record does not (its bytes would be gone too), unless it rebinds a key already in use."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

from tensorcast.gs.backend import ArtifactCommit
from tensorcast.gs.sqlite import SqliteBackend
from tensorcast.records import ArtifactInfo, TensorMeta


class Spy(SqliteBackend):
    def __init__(self, path: Path) -> None:
        super().__init__(path, "FULL")
        self.durable: list[bool] = []

    @contextlib.contextmanager
    def _tx(self, durable: bool = True) -> Iterator[sqlite3.Connection]:
        self.durable.append(durable)
        with super()._tx(durable) as db:
            yield db


def _artifact(n: int) -> ArtifactInfo:
    t = TensorMeta(name="t", dtype="uint8", shape=(4,), nbytes=4, digest=f"{n:064x}")
    return ArtifactInfo(id=f"tc-{n:032x}", tensors=(t,), nbytes=4, policy="cache")


def test_only_commits_a_power_loss_would_not_make_moot_wait_for_an_fsync(tmp_path: Path) -> None:
    async def go() -> list[bool]:
        b = Spy(tmp_path / "gs.sqlite3")
        await b.open()
        try:
            now = time.time()
            await b.commit_artifact(_artifact(1), "w0", None, None, now, ("memory",))
            await b.commit_artifact(_artifact(2), "w0", "fresh-key", None, now, ("memory",))
            await b.commit_artifact(_artifact(3), "w0", "fresh-key", None, now, ("memory",))  # rebinds it
            await b.commit_artifact(_artifact(4), "w0", None, None, now, ("memory", "disk"))
            await b.commit_artifact(_artifact(5), "w0", None, None, now, ("disk",))
            assert await b.resolve_key("fresh-key") == (_artifact(3).id, None)
            return b.durable
        finally:
            await b.close()

    assert asyncio.run(go()) == [False, False, True, True, True]


def test_a_group_commit_is_one_transaction_waiting_for_an_fsync_if_any_commit_needs_one(tmp_path: Path) -> None:
    async def go() -> list[bool]:
        b = Spy(tmp_path / "gs.sqlite3")
        await b.open()
        try:
            now = time.time()
            memory = [ArtifactCommit(_artifact(n), "w0", None, None) for n in range(3)]
            assert await b.commit_artifacts(memory, now) == [True] * 3
            mixed = [ArtifactCommit(_artifact(n), "w1", None, None) for n in range(3, 6)]
            mixed.append(ArtifactCommit(_artifact(6), "w1", None, None, ("disk",)))
            assert await b.commit_artifacts(mixed, now) == [True] * 4
            assert all([await b.get_artifact(_artifact(n).id) for n in range(7)])
            return b.durable
        finally:
            await b.close()

    assert asyncio.run(go()) == [False, True]
