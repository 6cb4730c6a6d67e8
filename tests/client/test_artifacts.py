"""Artifact semantics against a real cluster: dedup, keys, leases, listing, deletion."""

from __future__ import annotations

import time

import numpy as np
import pytest

import tensorcast as tc
from tensorcast.cluster import LocalCluster
from tensorcast.errors import InvalidArgument, NotFound


def _worker(client: tc.Client, worker_id: str) -> tc.WorkerInfo:
    return next(w for w in client.list_workers() if w.worker_id == worker_id)


def _wait_memory(client: tc.Client, worker_id: str, expect: int, timeout: float = 5.0) -> int:
    """The GS sees memory use at heartbeat time; wait for it to settle."""
    deadline = time.time() + timeout
    used = -1
    while time.time() < deadline:
        used = _worker(client, worker_id).memory_used
        if used == expect:
            return used
        time.sleep(0.1)
    return used


def _settled_memory(client: tc.Client, worker_id: str) -> int:
    """Memory use once two readings a heartbeat apart agree (earlier tests' deletions have landed)."""
    prev = _worker(client, worker_id).memory_used
    while True:
        time.sleep(1.2)
        cur = _worker(client, worker_id).memory_used
        if cur == prev:
            return cur
        prev = cur


def test_dedup_equal_bytes_one_id_one_copy(client: tc.Client, shared_cluster: LocalCluster) -> None:
    gateway = shared_cluster.worker_ids[0]
    base = _settled_memory(client, gateway)
    # Sizes above worker.small_object_bytes: each gets its own segment, charged at its exact size.
    x = np.random.default_rng(3).standard_normal((512, 256)).astype(np.float32)
    a1 = client.put(x, key="dedup/a")
    a2 = client.put(x.copy(), key="dedup/b")
    assert a1.id == a2.id
    assert set(client.artifact(a1.id).keys) == {"dedup/a", "dedup/b"}
    assert _wait_memory(client, gateway, base + x.nbytes) == base + x.nbytes

    shared = np.random.default_rng(4).standard_normal(1 << 18).astype(np.float32)
    own1 = np.ones(1 << 17, np.float32)
    own2 = np.zeros(1 << 17, np.float32)
    s1 = client.put({"embed": shared, "head": own1})
    s2 = client.put({"embed": shared, "head": own2})
    assert s1.id != s2.id
    expect = base + x.nbytes + shared.nbytes + own1.nbytes + own2.nbytes
    assert _wait_memory(client, gateway, expect) == expect, "a tensor shared by two artifacts is stored twice"
    assert s1.meta("embed").digest == s2.meta("embed").digest
    # Deleting one sharer keeps the shared bytes for the other.
    client.delete(s1.id)
    assert np.array_equal(client.artifact(s2.id).tensor("embed", like="numpy"), shared)
    for a in (a1.id, s2.id):
        client.delete(a)
    assert _wait_memory(client, gateway, base) == base


def test_key_moves_to_new_artifact(client: tc.Client) -> None:
    v1 = client.put(np.zeros(4, np.float32), key="model/latest")
    v2 = client.put(np.ones(4, np.float32), key="model/latest")
    assert v1.id != v2.id
    cur = client.artifact("model/latest")
    assert cur.id == v2.id
    assert np.array_equal(cur.tensor(like="numpy"), np.ones(4, np.float32))
    assert "model/latest" not in client.artifact(v1.id).keys  # the old one is still there by id
    keys = [a.key for a in client.ls("model/")]
    assert keys == ["model/latest"]
    client.delete(v1.id)
    client.delete("model/latest")
    with pytest.raises(NotFound):
        client.artifact("model/latest")


def test_ls_prefix(client: tc.Client) -> None:
    ids = [client.put(np.full(3, i, np.int32), key=f"ls-test/{i}").id for i in range(3)]
    client.put(np.full(3, 9, np.int32), key="other/9")
    assert sorted(a.key or "" for a in client.ls("ls-test/")) == ["ls-test/0", "ls-test/1", "ls-test/2"]
    assert {a.id for a in client.ls()} >= set(ids)
    for i in range(3):
        client.delete(f"ls-test/{i}")
    client.delete("other/9")


def test_lease_expires_unless_renewed(client: tc.Client, shared_cluster: LocalCluster) -> None:
    leased = client.put(np.arange(8), key="lease/short", ttl=1.0)
    # Renewed every 0.5 s for a 3 s lease: a busy host may delay one renewal by seconds, not by the lease.
    kept = client.put(np.arange(9), key="lease/renewed", ttl=3.0)
    assert leased.owner == "lease" and leased.lease_expiry is not None
    for _ in range(4):
        time.sleep(0.5)
        kept.renew(3.0)
    with pytest.raises(NotFound):
        client.artifact("lease/short")
    assert np.array_equal(client.artifact("lease/renewed").tensor(like="numpy"), np.arange(9))
    kept.release()
    with pytest.raises(NotFound):
        client.artifact("lease/renewed")
    system = client.put(np.arange(10), key="lease/system")
    with pytest.raises(InvalidArgument):
        system.renew(5)
    with pytest.raises(InvalidArgument):
        system.release()
    # A lease never downgrades a system-owned artifact.
    again = client.put(np.arange(10), key="lease/system", ttl=1.0)
    assert again.owner == "system"
    client.delete(system.id)


def test_expired_lease_frees_worker_memory(client: tc.Client, shared_cluster: LocalCluster) -> None:
    gateway = shared_cluster.worker_ids[0]
    before = _settled_memory(client, gateway)
    big = np.random.default_rng(5).integers(0, 255, 1 << 20, dtype=np.uint8)
    client.put(big, ttl=1.0)  # the shortest lease there is (tensorcast.limits.MIN_TTL)
    assert _wait_memory(client, gateway, before, timeout=8.0) == before


def test_module_level_default_client(shared_cluster: LocalCluster) -> None:
    client = tc.init(shared_cluster.address)
    try:
        art = tc.put({"x": np.arange(5)}, key="default/x")
        assert np.array_equal(tc.artifact("default/x").tensor("x", like="numpy"), np.arange(5))
        assert [a.key for a in tc.ls("default/")] == ["default/x"]
        assert len(tc.list_workers()) == 2
        tc.delete(art.id)
    finally:
        client.close()


def test_async_client(shared_cluster: LocalCluster) -> None:
    import asyncio

    import tensorcast.aio

    async def main() -> None:
        async with await tensorcast.aio.connect(shared_cluster.address) as ac:
            art = await ac.put({"x": np.arange(6)})
            got = await (await ac.artifact(art.id)).tensor("x", like="numpy")
            assert np.array_equal(got, np.arange(6))
            await ac.delete(art.id)

    asyncio.run(main())
