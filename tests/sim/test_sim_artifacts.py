"""Artifacts in the simulated cluster (``tensorcast.testing.sim``): durable puts survive a kill and restart of
their holder, a restart of the global store right after the put, and the delete of a sibling key; and the
checker fails when a worker serves other bytes or acknowledges a durable put it did not keep on disk; a put
whose record at the global store failed leaves no copy behind, without taking bytes from a put that counts on it."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from typing import Any

import pytest

from tensorcast import clock
from tensorcast.context import CallContext
from tensorcast.errors import NotFound, TensorCastError
from tensorcast.pool.placement import PutDecision, decide_put
from tensorcast.testing.sim import Checker, InvariantBroken, SimCluster, SimSettings, run_seed, settle, simulate
from tensorcast.testing.sim.artifacts import SimArtifacts
from tensorcast.transport.base import SourceLease
from tensorcast.wire.messages import DataRequest, GetArtifact

SETTINGS = SimSettings(homes=3, num_shards=8)


def client(cluster: SimCluster, checker: Checker) -> SimArtifacts:
    return SimArtifacts(cluster, checker.artifacts, random.Random(0))


async def all_readable(cluster: SimCluster, checker: Checker, arts: SimArtifacts) -> None:
    """The end-of-run promise: every acknowledged durable key readable (unless at risk), deleted keys gone."""
    await settle(cluster)
    lost = checker.artifacts.lost(await arts.missing())
    if lost:
        raise InvariantBroken(f"durable artifacts lost: {lost}; {checker.artifacts.where(lost[0])}")


def test_a_durable_artifact_survives_a_kill_and_restart_of_its_only_holder() -> None:
    async def body(cluster: SimCluster, checker: Checker) -> None:
        arts = client(cluster, checker)
        holder = cluster.workers["w1"]
        info = await arts.put("sim/k1/a", holder)
        assert {r.worker_id for r in info.replicas} == {"w1"} and {r.tier for r in info.replicas} >= {"disk"}
        holder.kill()
        await asyncio.sleep(2 * SETTINGS.liveness_timeout)  # the store sees it dead meanwhile
        assert not await arts.read("sim/k1/a")  # its only holder is down
        await cluster.restart(holder)
        await all_readable(cluster, checker, arts)
        assert checker.artifacts.read_back >= 1

    simulate(11, body, SETTINGS)


def test_a_global_store_restart_right_after_a_durable_put_loses_nothing() -> None:
    async def body(cluster: SimCluster, checker: Checker) -> None:
        arts = client(cluster, checker)
        for i, w in enumerate(cluster.live()):
            await arts.put(f"sim/k{i}/a", w)
        cluster.restart_gs()
        await asyncio.sleep(1.0)
        cluster.kill_gs()  # and once more, down for a while
        await asyncio.sleep(3.0)
        cluster.restart_gs()
        await all_readable(cluster, checker, arts)
        assert checker.artifacts.read_back == 3

    simulate(12, body, SETTINGS)


def test_deleting_a_sibling_key_keeps_the_bytes_for_the_other_and_a_re_put_after_the_last_delete_stays() -> None:
    async def body(cluster: SimCluster, checker: Checker) -> None:
        arts = client(cluster, checker)
        w0, w1 = cluster.workers["w0"], cluster.workers["w1"]
        first = await arts.put("sim/k1/a", w0)
        second = await arts.put("sim/k1/b", w1)  # the same bytes: one artifact, two keys, two holders
        assert first.id == second.id
        await arts.delete("sim/k1/a")
        await asyncio.sleep(3 * SETTINGS.heartbeat_interval)  # any drop would reach the holders meanwhile
        assert await arts.read("sim/k1/b")
        await arts.delete("sim/k1/b")  # the last key: the artifact goes, its holders drop it
        await arts.put("sim/k1/c", w0)  # put again at once, before w0's next heartbeat brings the drop
        await asyncio.sleep(3 * SETTINGS.heartbeat_interval)
        await all_readable(cluster, checker, arts)
        assert checker.artifacts.deleted == {"sim/k1/a", "sim/k1/b"}
        with pytest.raises(NotFound):
            await arts.caller.call(GetArtifact(key_or_id="sim/k1/a"), arts.caller.context(timeout=5.0))

    simulate(13, body, SETTINGS)


def test_a_put_the_global_store_did_not_record_leaves_no_copy_and_puts_that_count_on_it_keep_theirs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With the store down, durable puts fail after the worker stored them. Once the store is back and the
    failed commits could no longer reach it, the worker drops the copy nobody put (and its restart does not
    record it), while an acknowledged put of the same bytes, made while the copy was unrecorded, keeps its
    bytes: one made before the worker settles (it finds the copy there and stores nothing), and one
    acknowledged while the worker's question about the copy is on its way (a stale ``NotFound``)."""

    async def body(cluster: SimCluster, checker: Checker) -> None:
        arts = client(cluster, checker)
        w1 = cluster.workers["w1"]
        disk = w1.storage.store.disk
        assert disk is not None
        cluster.kill_gs()
        leaked: dict[str, str] = {}
        for stem in ("sim/u1", "sim/u2", "sim/u3"):
            before = set(disk.manifests)
            with pytest.raises(TensorCastError):
                await arts.put(f"{stem}/a", w1)
            (leaked[stem],) = set(disk.manifests) - before  # stored here, then its record failed
        orphan, early, racing = leaked["sim/u1"], leaked["sim/u2"], leaked["sim/u3"]
        cluster.restart_gs()
        assert (await arts.put("sim/u2/b", w1)).id == early  # while unrecorded: it counts on the copy here

        real = w1.link.add_replica
        raced: list[str] = []

        async def stale_answer(aid: str, tiers: tuple[str, ...], ctx: CallContext | None = None, *,
                               restored: bool = False) -> None:
            if aid == racing and not raced:  # the store answers, then a put of the same bytes is recorded
                raced.append((await arts.put("sim/u3/b", w1)).id)
                raise NotFound(f"no artifact {aid}")
            await real(aid, tiers, ctx, restored=restored)

        monkeypatch.setattr(w1.link, "add_replica", stale_answer)
        await asyncio.sleep(20.0)  # the failed commits' deadlines (10 s) pass, then a few housekeeping rounds
        assert w1.storage.store.tiers(orphan) == ()
        assert orphan not in disk.manifests and orphan not in w1.storage.store.memory.replica_ids()
        assert raced == [racing]
        for aid in (early, racing):
            assert "disk" in w1.storage.store.tiers(aid)
        assert not w1.storage.unrecorded.ids
        w1.kill()
        w1 = await cluster.restart(w1)  # its announcement finds nothing unrecorded to record
        await asyncio.sleep(3 * SETTINGS.heartbeat_interval)
        db = cluster.backend.db
        assert db.execute("SELECT 1 FROM artifacts WHERE artifact_id=?", (orphan,)).fetchone() is None
        assert db.execute("SELECT 1 FROM replicas WHERE artifact_id=?", (orphan,)).fetchone() is None
        with pytest.raises(NotFound):
            await w1.link.get_artifact(orphan, CallContext(deadline=clock.time() + 5.0))
        await all_readable(cluster, checker, arts)
        assert checker.artifacts.read_back == 2

    simulate(15, body, SETTINGS)


def test_the_checker_catches_a_worker_serving_other_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    from tensorcast.worker.store import LocalStore

    real = LocalStore.open_source

    def corrupted(self: LocalStore, req: DataRequest) -> SourceLease:
        lease = real(self, req)  # checksums are computed from what is served: the data plane sees no fault
        data = bytearray(lease.view)
        data[len(data) // 2] ^= 0x5A
        return dataclasses.replace(lease, view=memoryview(data), checksums=None, learn=None)

    monkeypatch.setattr(LocalStore, "open_source", corrupted)

    async def body(cluster: SimCluster, checker: Checker) -> None:
        arts = client(cluster, checker)
        await arts.put("sim/k1/a", cluster.workers["w0"])
        await arts.read("sim/k1/a")

    with pytest.raises(InvariantBroken, match="bytes other than those put"):
        simulate(14, body, SETTINGS)


def test_the_checker_catches_a_durable_put_acknowledged_without_its_disk_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    def memory_only(*args: Any, **kwargs: Any) -> PutDecision:
        decision = decide_put(*args, **kwargs)
        return PutDecision(to_memory=True, to_disk=False, evict=decision.evict)

    monkeypatch.setattr("tensorcast.worker.puts.decide_put", memory_only)
    for seed in range(40):
        try:
            run_seed(seed, fault_seconds=20)
        except InvariantBroken as exc:
            assert str(seed) in str(exc) and "durable artifacts lost" in str(exc)
            return
    pytest.fail("durable puts without a disk copy were not caught in 40 seeds")
