"""Keys are independent names for content, against a real cluster: equal bytes under two keys are one artifact
with two references; deleting, releasing or outliving one key leaves the other and the bytes; the bytes go with
the last reference, or at once with a delete by id."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

import tensorcast as tc
from tensorcast.cluster import LocalCluster
from tensorcast.errors import InvalidArgument, NotFound
from tensorcast.testing import running_cluster
from tensorcast.testing.etcd import EtcdCluster


def _fresh(shared_cluster: LocalCluster, *, remote: bool = True) -> tc.Client:
    """A client that kept no mapping of anything (and, ``remote``, reads over the network): what it reads
    comes from a worker that still holds the bytes."""
    config = tc.Config.from_flat({"client.host_id": "another-host"} if remote else {})
    return tc.connect(shared_cluster.address, config=config)


def _until(done: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.time() + seconds
    while not done():
        assert time.time() < deadline, f"not within {seconds:.1f}s: {what}"
        time.sleep(0.05)


def _gone(client: tc.Client, key_or_id: str) -> bool:
    try:
        client.artifact(key_or_id)
    except NotFound:
        return True
    return False


def _reap_margin(shared_cluster: LocalCluster) -> float:
    """How long after a lease ends the reaper has surely run, with room for a busy machine."""
    cfg = tc.Config.from_flat(shared_cluster.config)
    return 10 * cfg.gs.lease_reap_interval + 5.0


def test_two_keys_same_bytes_delete_one(client: tc.Client, shared_cluster: LocalCluster) -> None:
    x = np.random.default_rng(11).standard_normal((256, 128)).astype(np.float32)
    a = client.put(x, key="keys/a")
    b = client.put(x.copy(), key="keys/b")
    assert a.id == b.id and (a.key, b.key) == ("keys/a", "keys/b")
    assert client.artifact("keys/b").key == "keys/b" and client.artifact(a.id).keys == ("keys/a", "keys/b")
    assert [(h.key, h.id) for h in client.ls("keys/")] == [("keys/a", a.id), ("keys/b", a.id)]
    assert {h.key for h in client.ls() if h.id == a.id} == {"keys/a", "keys/b"}

    done = client.delete("keys/a")
    assert done == a.id and not done.removed and done.keys == ("keys/b",)
    with pytest.raises(NotFound, match="deleted"):
        client.artifact("keys/a")
    with _fresh(shared_cluster) as other:
        assert np.array_equal(other.artifact("keys/b").tensor(like="numpy"), x)
    assert [(h.key, h.id) for h in client.ls("keys/")] == [("keys/b", a.id)]
    assert client.artifact(a.id).keys == ("keys/b",)

    last = client.delete("keys/b")
    assert last == a.id and last.removed
    assert _gone(client, a.id) and _gone(client, "keys/b")


def test_a_version_equal_to_a_deleted_one_stays(client: tc.Client, shared_cluster: LocalCluster) -> None:
    sd = {"w": np.arange(64, dtype=np.float32).reshape(8, 8), "b": np.ones(8, np.float32)}
    v1 = client.put(sd, key="sd/m@v1")
    v2 = client.put({k: v.copy() for k, v in sd.items()}, key="sd/m@v2")
    assert v1.id == v2.id and v2.key == "sd/m@v2"
    client.delete("sd/m@v1")
    with _fresh(shared_cluster) as other:
        got = other.artifact("sd/m@v2").tensor_dict(like="numpy")
    assert set(got) == set(sd) and all(np.array_equal(got[k], sd[k]) for k in sd)
    assert [h.key for h in client.ls("sd/")] == ["sd/m@v2"]
    client.delete("sd/m@v2")


def test_a_leased_key_ends_a_permanent_key_keeps_the_content(client: tc.Client, shared_cluster: LocalCluster) -> None:
    # Content no other test of the shared cluster puts: content is shared by every key naming it.
    x = np.random.default_rng(4242).integers(0, 1 << 40, 1000)
    leased = client.put(x, key="mixed/leased", ttl=1.0)
    permanent = client.put(x.copy(), key="mixed/permanent")
    # Leased after the other: once the reaper has unbound this key (its tombstone says so), it has been
    # through the other lease too.
    client.put(np.random.default_rng(4243).integers(0, 1 << 40, 3), key="mixed/control", ttl=1.0)
    assert leased.id == permanent.id and permanent.owner == "system"
    assert client.artifact("mixed/leased").owner == "system"  # some reference is permanent
    _until(lambda: "lease expired" in _why(client, "mixed/control"), 1.0 + _reap_margin(shared_cluster),
           "the reaper")
    assert "lease expired" in _why(client, "mixed/leased")
    with _fresh(shared_cluster) as other:
        assert np.array_equal(other.artifact("mixed/permanent").tensor(like="numpy"), x)
    assert [h.key for h in client.ls("mixed/")] == ["mixed/permanent"]
    assert client.artifact(permanent.id).keys == ("mixed/permanent",)
    client.delete(permanent.id)


def _why(client: tc.Client, key_or_id: str) -> str:
    try:
        client.artifact(key_or_id)
    except NotFound as exc:
        return exc.message
    return ""


def test_releasing_one_leased_key_leaves_another(client: tc.Client, shared_cluster: LocalCluster) -> None:
    x = np.full(4096, 7, np.uint8)
    mine = client.put(x, key="lease2/mine", ttl=60.0)
    theirs = client.put(x.copy(), key="lease2/theirs", ttl=60.0)
    assert mine.id == theirs.id and mine.owner == "lease"
    theirs.renew(120.0)
    assert theirs.lease_expiry is not None and theirs.lease_expiry > time.time() + 90
    done = mine.release()
    assert not done.removed and done.keys == ("lease2/theirs",)
    assert _gone(client, "lease2/mine")
    with pytest.raises(NotFound):
        mine.renew(30.0)  # its own reference is gone: renewing it does not touch the other key
    with _fresh(shared_cluster) as other:
        assert np.array_equal(other.artifact("lease2/theirs").tensor(like="numpy"), x)
    # A permanent key cannot be released or renewed; a put without a key and a ttl is its own lease.
    pinned = client.put(x.copy(), key="lease2/permanent")
    with pytest.raises(InvalidArgument, match="permanently"):
        pinned.release()
    with pytest.raises(InvalidArgument, match="permanently"):
        pinned.renew(5.0)
    anonymous = client.put(x.copy(), ttl=60.0)
    assert anonymous.key == "lease2/permanent" and anonymous.own_key is None  # the first key, as before
    assert not anonymous.release().removed  # ended its own lease only
    assert client.delete("lease2/permanent").keys == ("lease2/theirs",)
    assert client.artifact("lease2/theirs").release().removed  # the last reference
    assert _gone(client, mine.id)


def test_delete_by_id_removes_every_key(client: tc.Client, shared_cluster: LocalCluster) -> None:
    x = np.arange(77, dtype=np.int16)
    ids = {client.put(x.copy(), key=f"byid/{i}").id for i in range(3)}
    (aid,) = ids
    done = client.delete(aid)
    assert done == aid and done.removed and done.keys == ()
    for i in range(3):
        with pytest.raises(NotFound, match="deleted"):
            client.artifact(f"byid/{i}")
    assert client.ls("byid/") == [] and _gone(client, aid)


def test_ls_without_prefix_lists_every_key_and_the_keyless(client: tc.Client) -> None:
    x = np.arange(5, dtype=np.int8) + 100
    keyless = client.put(np.arange(5, dtype=np.int8) + 50)
    client.put(x, key="every/one")
    client.put(x.copy(), key="every/two")
    entries = [(h.key, h.id) for h in client.ls()]
    assert [k for k, aid in entries if aid == keyless.id] == [None]
    assert sorted(str(k) for k, aid in entries if aid == client.artifact("every/one").id) == ["every/one",
                                                                                            "every/two"]
    assert [(h.key, h.id) for h in client.ls(limit=1)] == entries[:1]
    client.delete(keyless.id)
    client.delete("every/one")
    client.delete("every/two")


def test_publisher_gc_keeps_a_live_version_equal_to_a_deleted_one(client: tc.Client,
                                                                  shared_cluster: LocalCluster) -> None:
    """keep_last=1: publishing v2 (equal to v1) deletes v1, and v2 stays readable and listed; content a user
    also keeps under another key stays when GC deletes its version."""
    sd = {"w": np.arange(32, dtype=np.float32), "b": np.zeros(4, np.float32)}
    pub = client.publisher("gc-equal", keep_last=1)
    pub.publish(sd)
    best = client.artifact("gc-equal@v1")
    client.put(best.tensor_dict(like="numpy"), key="gc-equal/best")  # the same content, under a user's key
    p2 = pub.publish({k: v.copy() for k, v in sd.items()})
    assert p2.version == 2 and p2.deleted == (1,) and pub.versions() == [2]
    with _fresh(shared_cluster) as other:
        got = other.artifact("gc-equal@v2").tensor_dict(like="numpy")
        assert all(np.array_equal(got[k], sd[k]) for k in sd)
        kept = other.artifact("gc-equal/best").tensor_dict(like="numpy")
        assert all(np.array_equal(kept[k], sd[k]) for k in sd)
    assert _gone(client, "gc-equal@v1")
    client.delete("gc-equal@v2")
    client.delete("gc-equal/best")


def test_keys_are_independent_on_etcd_with_two_global_stores(etcd_cluster: EtcdCluster) -> None:
    """The same semantics with the metadata on etcd, a gateway's requests spread over two global stores."""
    with running_cluster(workers=1, etcd=etcd_cluster.urls, global_stores=2) as cluster, \
            tc.connect(cluster.address) as c:
        x = np.random.default_rng(12).integers(0, 255, 8192, dtype=np.uint8)
        a = c.put(x, key="etcd-keys/a", ttl=60.0)
        b = c.put(x.copy(), key="etcd-keys/b")
        assert a.id == b.id and [h.key for h in c.ls("etcd-keys/")] == ["etcd-keys/a", "etcd-keys/b"]
        assert not a.release().removed and _gone(c, "etcd-keys/a")
        c.put(x.copy(), key="etcd-keys/c")
        assert c.delete("etcd-keys/b").keys == ("etcd-keys/c",)
        with _fresh(cluster) as other:
            assert np.array_equal(other.artifact("etcd-keys/c").tensor(like="numpy"), x)
        assert c.delete("etcd-keys/c").removed and _gone(c, a.id)
