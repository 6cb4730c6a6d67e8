"""An artifact's commit, read, renewal and deletion read the rows of its holders only, not the whole workers
table (which grows with the cluster, and was read for every one of them), and still report each replica's
worker as it is: its address, and whether it is alive."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from tensorcast.config import Config
from tensorcast.context import CallContext
from tensorcast.gs.service import GlobalStore
from tensorcast.gs.sqlite import SqliteBackend
from tensorcast.records import ArtifactInfo, TensorMeta, WorkerInfo
from tensorcast.wire.messages import (
    CommitArtifact,
    CommitArtifacts,
    DeleteArtifact,
    GetArtifact,
    ListWorkers,
    RegisterWorker,
    RenewLease,
)
from tensorcast.wire.rpc import Request


class Counting(SqliteBackend):
    def __init__(self, path: Path) -> None:
        super().__init__(path, "FULL")
        self.full_reads = 0

    async def list_workers(self) -> list[WorkerInfo]:
        self.full_reads += 1
        return await super().list_workers()


def _commit(n: int, worker: str, key: str | None = None, ttl: float | None = None) -> CommitArtifact:
    t = TensorMeta(name="t", dtype="uint8", shape=(4,), nbytes=4, digest=f"{n:064x}")
    return CommitArtifact(artifact=ArtifactInfo(id=f"tc-{n:032x}", tensors=(t,), nbytes=4), worker_id=worker,
                          key=key, ttl=ttl)


def test_reads_of_one_artifact_read_only_its_holders(tmp_path: Path) -> None:
    async def main() -> None:
        backend = Counting(tmp_path / "gs.sqlite3")
        await backend.open()
        gs = GlobalStore(backend, Config())
        req = Request(conn=None, ctx=CallContext(deadline=time.time() + 10), payload=None, peer=None)
        try:
            for i in range(50):
                info = WorkerInfo(worker_id=f"w{i}", address=f"10.0.0.{i}:7000", host_id=f"h{i}", roles=("basic",))
                await gs.register_worker(RegisterWorker(worker=info), req)
            backend.full_reads = 0
            got = (await gs.commit_artifact(_commit(1, "w7", key="one"), req)).artifact
            assert [(r.worker_id, r.address, r.alive) for r in got.replicas] == [("w7", "10.0.0.7:7000", True)]
            done = await gs.commit_artifacts(CommitArtifacts(commits=(_commit(2, "w8"), _commit(1, "w9"))), req)
            assert [[r.worker_id for r in o.artifact.replicas] for o in done.outcomes if o.artifact] == \
                [["w8"], ["w7", "w9"]]
            read = (await gs.get_artifact(GetArtifact(key_or_id="one"), req)).artifact
            assert {r.worker_id: r.address for r in read.replicas} == {"w7": "10.0.0.7:7000", "w9": "10.0.0.9:7000"}
            leased = (await gs.commit_artifact(_commit(3, "w3", key="leased", ttl=60.0), req)).artifact
            renewed = (await gs.renew_lease(RenewLease(artifact_id=leased.id, key="leased", ttl=120.0), req)).artifact
            assert [r.worker_id for r in renewed.replicas] == ["w3"]
            gone = await gs.delete_artifact(DeleteArtifact(key_or_id=got.id), req)
            assert sorted((r.worker_id, r.address) for r in gone.replicas) == \
                [("w7", "10.0.0.7:7000"), ("w9", "10.0.0.9:7000")]
            assert backend.full_reads == 0
            assert len((await gs.list_workers(ListWorkers(), req)).workers) == 50 and backend.full_reads == 1
        finally:
            await backend.close()

    asyncio.run(main())
