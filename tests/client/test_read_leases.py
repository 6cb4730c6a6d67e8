"""Read leases, with real processes (``gs.read_leases``, ``worker.held_reads``): the gateway holding an
artifact's checked memory copy answers its host's look-ups of the id without the global store, and whatever
deletes the artifact takes that back before it returns: a look-up through the holder right after a delete from
another host says it is gone (by id or by its last key); a holder that cannot be told (SIGSTOP) holds the delete up
for at most one lease and answers nothing from it when it wakes; a revocation names its holder; a global-store
restart forgets no lease; a leased artifact (which can end by time alone) gets none."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

import tensorcast as tc
from tensorcast.errors import NotFound
from tensorcast.testing import running_cluster
from tensorcast.wire.kv_messages import GSStats
from tensorcast.wire.messages import RevokeReads

LEASE = 2.0
TOKEN = "read-leases-secret"  # the store authenticates to the holders it revokes
# No idle verification: the test's own first read checks the bytes (what lets the holder name its places).
CONFIG = {"gs.read_lease_seconds": LEASE, "worker.verify_idle_bytes": 0}


@pytest.fixture(scope="module")
def cluster() -> Iterator[tc.LocalCluster]:
    with running_cluster(workers=2, hosts=2, config=CONFIG, token=TOKEN) as c:
        yield c


def _client(cluster: tc.LocalCluster, index: int) -> tc.Client:
    """A caller on host ``index``, through that host's worker."""
    wid = cluster.worker_ids[index]
    c = tc.connect(cluster.workers[wid].address, token=cluster.token,
                   config=tc.Config.from_flat({"client.host_id": cluster.host_id_of(index)}))
    assert c.aio.caller.address == cluster.workers[wid].address
    return c


@pytest.fixture()
def near(cluster: tc.LocalCluster) -> Iterator[tc.Client]:
    with _client(cluster, 0) as c:
        yield c


@pytest.fixture()
def far(cluster: tc.LocalCluster) -> Iterator[tc.Client]:
    with _client(cluster, 1) as c:
        yield c


def _gs_lookups(cluster: tc.LocalCluster) -> int:
    """``GetArtifact`` requests the global store has served."""
    with tc.connect(cluster.gs_address, token=cluster.token) as gs:
        return gs._run(gs.aio.caller.call(GSStats())).requests.get("GetArtifact", 0)


def _leased(near: tc.Client, seed: int, **put: object) -> tuple[tc.Artifact, np.ndarray]:
    """An artifact put through the near worker and read once there (its bytes checked)."""
    data = np.random.default_rng(seed).integers(0, 255, (256, 1024), dtype=np.uint8)
    art = near.put(data, **put)
    assert np.array_equal(near.artifact(art.id).tensor(like="numpy"), data)
    return art, data


def test_the_holder_answers_look_ups_of_an_id_without_the_store(cluster: tc.LocalCluster, near: tc.Client) -> None:
    art, data = _leased(near, 1)
    near.artifact(art.id)  # the lease's grant (if the read's look-up did not take it)
    before = _gs_lookups(cluster)
    t0 = time.monotonic()
    for _ in range(20):
        assert np.array_equal(near.artifact(art.id).tensor(like="numpy"), data)
    renewals = int((time.monotonic() - t0) // (LEASE / 2)) + 1
    assert _gs_lookups(cluster) - before <= renewals
    near.delete(art.id)


def test_a_leased_artifact_is_always_looked_up_at_the_store(cluster: tc.LocalCluster, near: tc.Client) -> None:
    art, _ = _leased(near, 2, ttl=60)
    before = _gs_lookups(cluster)
    for _ in range(5):
        near.artifact(art.id)
    assert _gs_lookups(cluster) - before == 5
    near.delete(art.id)


def test_a_delete_on_another_host_revokes_the_holder_before_it_returns(near: tc.Client, far: tc.Client) -> None:
    for seed in range(10, 16):
        art, _ = _leased(near, seed)
        near.artifact(art.id)
        t0 = time.monotonic()
        far.delete(art.id)
        took = time.monotonic() - t0
        with pytest.raises(NotFound):
            near.artifact(art.id)
        assert took < LEASE / 2  # the holder was told, not waited out


def test_a_stopped_holder_holds_a_delete_up_one_lease_at_most(cluster: tc.LocalCluster, near: tc.Client,
                                                              far: tc.Client) -> None:
    art, _ = _leased(near, 20)
    near.artifact(art.id)
    granted = time.monotonic()
    cluster.pause_worker(cluster.worker_ids[0])
    try:
        far.delete(art.id)
        took = time.monotonic() - granted
    finally:
        cluster.resume_worker(cluster.worker_ids[0])
    assert LEASE * 0.5 < took < LEASE + 1.0  # waited for the lease to end: no longer
    with pytest.raises(NotFound):  # awake, its lease (shorter by its own clock) ended before the delete returned
        near.artifact(art.id)


def test_deleting_its_last_key_revokes_too(near: tc.Client, far: tc.Client) -> None:
    data = np.random.default_rng(40).integers(0, 255, (64, 1024), dtype=np.uint8)
    art = near.put(data, key="leases/only-key")
    assert np.array_equal(near.artifact(art.id).tensor(like="numpy"), data)
    near.artifact(art.id)
    far.delete("leases/only-key")  # its last reference: the artifact goes with it
    with pytest.raises(NotFound):
        near.artifact(art.id)


def test_a_revocation_is_taken_only_by_the_holder_it_names(cluster: tc.LocalCluster, near: tc.Client) -> None:
    """A worker now at a holder's address that is not the holder (a restart under another id) refuses it, and the
    store waits the lease out instead; the holder itself stops answering at once."""
    art, _ = _leased(near, 50)
    near.artifact(art.id)
    holder = cluster.worker_ids[0]
    with pytest.raises(NotFound):
        near._run(near.aio.caller.call(RevokeReads(artifact_ids=(art.id,), worker_id="someone-else")))
    before = _gs_lookups(cluster)
    near.artifact(art.id)
    assert _gs_lookups(cluster) == before  # still answered by the holder
    near._run(near.aio.caller.call(RevokeReads(artifact_ids=(art.id,), worker_id=holder)))
    near.artifact(art.id)
    assert _gs_lookups(cluster) == before + 1  # asked the store
    near.delete(art.id)


def test_leases_outlive_a_global_store_restart() -> None:
    """A lease long enough to outlast the restart: the holder still answers without the new store process, and a
    delete there revokes it (the lease was on disk, not in the old process's memory)."""
    long_lease = {**CONFIG, "gs.read_lease_seconds": 30.0}
    with running_cluster(workers=2, hosts=2, config=long_lease, token=TOKEN) as cluster, \
            _client(cluster, 0) as near, _client(cluster, 1) as far:
        art, _ = _leased(near, 30)
        near.artifact(art.id)
        cluster.restart_global_store()
        before = _gs_lookups(cluster)
        near.artifact(art.id)
        assert _gs_lookups(cluster) == before  # the holder answered: its lease is still on
        t0 = time.monotonic()
        far.delete(art.id)
        assert time.monotonic() - t0 < 10.0  # told, not waited out (30 s)
        with pytest.raises(NotFound):
            near.artifact(art.id)
