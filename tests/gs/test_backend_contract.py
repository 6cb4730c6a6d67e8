"""The contract every global-store backend must pass (``gs.backend.MetadataBackend``): run against each
backend in ``BACKENDS``: SQLite, and etcd (a real 3-member cluster, a fresh key prefix per test)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tensorcast.gs.backend import ArtifactCommit, MetadataBackend, Unbound
from tensorcast.gs.etcd import EtcdBackend
from tensorcast.gs.refs import References
from tensorcast.gs.sqlite import SqliteBackend
from tensorcast.kv.leases import LeaseRecord
from tensorcast.records import ArtifactInfo, InstanceInfo, TensorMeta, WorkerInfo, WorkerLoad

# name -> factory(directory, etcd endpoints) of a backend (not opened); two factories on one directory see the
# same data.
BACKENDS: dict[str, Callable[[Path, str], MetadataBackend]] = {
    "sqlite": lambda d, _: SqliteBackend(d / "gs.sqlite3", "FULL"),
    "etcd": lambda d, endpoints: EtcdBackend(endpoints, prefix=f"/contract/{d.name}/"),
}
# Every field distinct, so that a column mixed up with another shows.
STATS = WorkerLoad(memory_used=1, memory_capacity=2, artifacts=3, disk_used=4, disk_capacity=5, net_in_bps=6.5,
                   net_out_bps=7.5, transfers_in_flight=8, memory_prefaulted=9, plans_in_flight=10)


# One event loop for the whole module: a backend with an asyncio client stays on the loop it opened on.
_loop = asyncio.new_event_loop()


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return _loop.run_until_complete(coro)


@pytest.fixture(params=sorted(BACKENDS))
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], MetadataBackend]]:
    opened: list[MetadataBackend] = []
    endpoints = request.getfixturevalue("etcd_cluster").endpoints if request.param == "etcd" else ""

    def factory() -> MetadataBackend:
        backend = BACKENDS[request.param](tmp_path, endpoints)
        run(backend.open())
        opened.append(backend)
        return backend

    yield factory
    for b in opened:
        run(b.close())


def worker(wid: str, address: str = "127.0.0.1:1") -> WorkerInfo:
    return WorkerInfo(worker_id=wid, address=address, host_id="h", roles=("basic",))


def artifact(aid: str, nbytes: int = 8) -> ArtifactInfo:
    t = TensorMeta(name="t", dtype="uint8", shape=(nbytes,), nbytes=nbytes, digest="0" * 64)
    return ArtifactInfo(id=aid, tensors=(t,), nbytes=nbytes, policy="durable", meta={"k": "v"})


def wanting(aid: str, copies: int) -> ArtifactInfo:
    return msgspec.structs.replace(artifact(aid), replicas_wanted=copies)


A, B, C = "tc-" + "a" * 32, "tc-" + "b" * 32, "tc-" + "d" * 32


def test_workers_register_with_increasing_incarnations(make: Callable[[], MetadataBackend]) -> None:
    b = make()
    assert run(b.register_worker(worker("w0"), 1.0)) == (1, [])
    assert run(b.register_worker(worker("w0", "127.0.0.1:2"), 2.0)) == (2, [])
    got = run(b.get_worker("w0"))
    assert got is not None and got.address == "127.0.0.1:2" and got.incarnation == 2
    assert run(b.get_worker("nope")) is None
    run(b.register_worker(worker("w1"), 3.0))
    assert [w.worker_id for w in run(b.list_workers())] == ["w0", "w1"]


def test_heartbeats_need_the_current_incarnation(make: Callable[[], MetadataBackend]) -> None:
    b = make()
    inc, _ = run(b.register_worker(worker("w0"), 1.0))
    assert run(b.heartbeat("w0", inc, STATS, 5.0, ())) == (True, ())
    assert run(b.get_worker("w0")).last_heartbeat == 5.0
    assert run(b.get_worker("w0")).load == STATS  # every field of the load, each in its own place
    assert run(b.heartbeat("w0", inc + 1, STATS, 6.0, ()))[0] is False  # a stale or future incarnation
    assert run(b.heartbeat("ghost", 1, STATS, 6.0, ()))[0] is False


def test_commit_records_artifact_key_and_replicas_atomically(make: Callable[[], MetadataBackend]) -> None:
    b = make()
    run(b.commit_artifact(artifact(A), "w0", "m@v1", None, 10.0, ("memory", "disk")))
    row = run(b.get_artifact(A))
    assert row is not None and row.refs == References((("m@v1", None),)) and row.info.meta == {"k": "v"}
    assert row.info.tensors == artifact(A).tensors and row.info.policy == "durable"
    assert run(b.resolve_key("m@v1")) == (A, None)
    assert sorted(run(b.replicas_of(A))) == [("w0", "disk"), ("w0", "memory")]
    # Putting another artifact under the key moves it; the first keeps what the key held (reachable by id).
    run(b.commit_artifact(artifact(B), "w1", "m@v1", None, 11.0))
    assert run(b.resolve_key("m@v1")) == (B, None)
    assert run(b.get_artifact(A)).refs == References(anonymous=True, anon_expiry=None)
    assert run(b.resolve_key("missing")) is None and run(b.get_artifact("tc-" + "c" * 32)) is None


def test_leases_merge_system_ownership_wins(make: Callable[[], MetadataBackend]) -> None:
    b = make()
    run(b.commit_artifact(artifact(A), "w0", None, 100.0, 1.0))
    run(b.commit_artifact(artifact(A), "w0", None, 50.0, 2.0))  # two leases: the later expiry stays
    assert run(b.get_artifact(A)).refs == References(anonymous=True, anon_expiry=100.0)
    run(b.commit_artifact(artifact(A), "w0", None, None, 3.0))  # a system-owned put upgrades it
    assert run(b.get_artifact(A)).refs == References(anonymous=True, anon_expiry=None)
    run(b.commit_artifact(artifact(A), "w0", None, 500.0, 4.0))  # and a lease never downgrades it
    assert run(b.get_artifact(A)).refs == References(anonymous=True, anon_expiry=None)
    assert not run(b.set_lease(A, None, 7.0))  # a system hold has no lease
    # The same rule per key binding, independently of the anonymous reference and of other keys.
    run(b.commit_artifact(artifact(A), "w0", "k", 100.0, 5.0))
    run(b.commit_artifact(artifact(A), "w0", "k", 50.0, 5.0))
    run(b.commit_artifact(artifact(A), "w0", "p", None, 5.0))
    run(b.commit_artifact(artifact(A), "w0", "p", 60.0, 5.0))
    assert run(b.get_artifact(A)).refs.bindings == (("k", 100.0), ("p", None))
    assert run(b.set_lease(A, "k", 7.0)) and not run(b.set_lease(A, "p", 7.0)) and not run(b.set_lease(A, "q", 7.0))
    assert run(b.resolve_key("k")) == (A, 7.0)
    assert run(b.expired_references(8.0)) == [(A, "k")] and run(b.expired_references(6.0)) == []
    assert not run(b.set_lease("tc-" + "c" * 32, None, 1.0))


def test_keys_are_independent_references(make: Callable[[], MetadataBackend]) -> None:
    """Equal content under two keys: unbinding one key leaves the other and the content; the last goes with
    the content, whose holders then owe drops."""
    b = make()
    run(b.register_worker(worker("w0"), 1.0))
    run(b.commit_artifact(artifact(A), "w0", "a", None, 1.0))
    run(b.commit_artifact(artifact(A), "w0", "b", 50.0, 2.0))
    assert run(b.unbind(A, "a", 3.0, "deleted")) == Unbound(False, keys=("b",))
    assert run(b.resolve_key("a")) is None and run(b.tombstone("a")) == (A, "deleted")
    assert run(b.resolve_key("b")) == (A, 50.0) and run(b.tombstone(A)) is None
    assert run(b.replicas_of(A)) == [("w0", "memory")]
    assert run(b.unbind(A, "a", 3.0, "deleted")) is None  # not bound any more
    assert run(b.unbind(A, "b", 4.0, "released")) == Unbound(True, ("w0",))
    assert run(b.get_artifact(A)) is None and run(b.tombstone(A)) == (A, "released")
    assert run(b.tombstone("b")) == (A, "released")
    # Bound again: the key's tombstone goes.
    run(b.commit_artifact(artifact(A), "w0", "a", None, 5.0))
    assert run(b.tombstone("a")) is None and run(b.tombstone(A)) is None


def test_expired_references_are_unbound_the_rest_keeps_the_content(make: Callable[[], MetadataBackend]) -> None:
    b = make()
    run(b.commit_artifact(artifact(A), "w0", "leased", 5.0, 1.0))
    run(b.commit_artifact(artifact(A), "w0", "kept", None, 1.0))
    run(b.commit_artifact(artifact(B), "w0", None, 5.0, 1.0))
    run(b.commit_artifact(artifact(B), "w0", "bk", None, 1.0))
    assert sorted(run(b.expired_references(6.0)), key=str) == sorted([(A, "leased"), (B, None)], key=str)
    assert run(b.unbind(A, "leased", 6.0, "its lease expired", expired_only=True)) == Unbound(False, keys=("kept",))
    assert run(b.unbind(B, None, 6.0, "its lease expired", expired_only=True)) == Unbound(False, keys=("bk",))
    assert run(b.tombstone("leased")) == (A, "its lease expired") and run(b.expired_references(6.0)) == []
    # The reaper never removes a live reference (one renewed after it was listed).
    assert run(b.unbind(A, "kept", 6.0, "its lease expired", expired_only=True)) == Unbound(False, keys=("kept",))
    assert run(b.resolve_key("kept")) == (A, None)
    assert run(b.get_artifact(B)).refs == References((("bk", None),))
    # An anonymous lease alone: when it ends, the artifact goes.
    run(b.commit_artifact(artifact(C), "w0", None, 5.0, 1.0))
    assert run(b.unbind(C, None, 6.0, "its lease expired", expired_only=True)) == Unbound(True, ("w0",))
    assert run(b.tombstone(C)) == (C, "its lease expired")


def _all_pages(b: MetadataBackend, prefix: str, limit: int, now: float = 0.0) -> tuple[list[tuple[str | None, str]],
                                                                                        int]:
    out, after, pages = [], "", 0
    while True:
        entries, after = run(b.list_artifacts(prefix, limit, after, now))
        assert len(entries) <= limit
        out += entries
        pages += 1
        if not after:
            return out, pages


def test_listing_is_one_entry_per_key_then_artifacts_without_one(make: Callable[[], MetadataBackend]) -> None:
    b = make()
    ids = [f"tc-{i:032x}" for i in range(5)]
    for i, aid in enumerate(ids):
        run(b.commit_artifact(artifact(aid), "w0", f"p/{i}" if i < 4 else "q/0", None, float(i)))
    run(b.commit_artifact(artifact(ids[0]), "w0", "p/0-alias", None, 9.0))  # two keys under the prefix
    run(b.commit_artifact(artifact(ids[1]), "w0", "p/1-leased", 5.0, 9.0))  # listed until its lease ends
    keyless = ["tc-" + "e" * 32, "tc-" + "f" * 32]
    for aid in keyless:
        run(b.commit_artifact(artifact(aid), "w0", None, None, 9.0))
    by_key = [("p/0", ids[0]), ("p/0-alias", ids[0]), ("p/1", ids[1]), ("p/1-leased", ids[1]), ("p/2", ids[2]),
              ("p/3", ids[3])]
    assert run(b.list_artifacts("p/", 100, "", 1.0)) == (by_key, "")
    assert run(b.list_artifacts("p/", 100, "", 6.0))[0] == [e for e in by_key if e[0] != "p/1-leased"]
    page, cursor = run(b.list_artifacts("p/", 2, "", 1.0))
    assert page == by_key[:2] and cursor
    got, pages = _all_pages(b, "p/", 2, 1.0)
    assert got == by_key and pages == 4  # three full pages, then an empty last one
    everything = [*by_key, ("q/0", ids[4]), *((None, aid) for aid in keyless)]
    assert run(b.list_artifacts("", 100, "", 1.0))[0] == everything
    for limit in (1, 2, 3, 7):
        assert _all_pages(b, "", limit, 1.0)[0] == everything
    assert run(b.list_artifacts("zzz", 100, "", 1.0)) == ([], "")


def test_many_artifacts_under_one_prefix_are_all_listed(make: Callable[[], MetadataBackend]) -> None:
    b = make()
    n = 2500
    for i in range(n):
        run(b.commit_artifact(artifact(f"tc-{i:032x}"), "w0", f"big/{i:05d}", None, 1.0))
    got, pages = _all_pages(b, "big/", 1000)
    assert len(got) == len({k for k, _ in got}) == n and pages == 3


def test_delete_turns_replicas_into_drops_until_acknowledged(make: Callable[[], MetadataBackend]) -> None:
    b = make()
    inc0, _ = run(b.register_worker(worker("w0"), 1.0))
    inc1, _ = run(b.register_worker(worker("w1"), 1.0))
    run(b.commit_artifact(artifact(A), "w0", "k", None, 2.0))
    assert run(b.add_replica(A, "w1", ("memory",)))
    assert sorted(run(b.delete_artifact(A, 2.5))) == ["w0", "w1"]
    assert run(b.get_artifact(A)) is None and run(b.resolve_key("k")) is None
    assert run(b.tombstone(A)) == (A, "deleted") and run(b.tombstone("k")) == (A, "deleted")
    assert run(b.heartbeat("w0", inc0, STATS, 3.0, ())) == (True, (A,))  # told until it acknowledges
    inc0, _ = run(b.register_worker(worker("w0"), 3.5))  # a restart does not forget what it must drop
    assert run(b.heartbeat("w0", inc0, STATS, 3.6, ())) == (True, (A,))
    assert run(b.heartbeat("w0", inc0, STATS, 4.0, (A,))) == (True, ())
    assert run(b.replicas_of(A)) == [("w1", "memory")]
    # Put again before w1 acknowledged: its replica is wanted again, so the drop is withdrawn.
    run(b.commit_artifact(artifact(A), "w1", None, None, 5.0))
    assert run(b.heartbeat("w1", inc1, STATS, 6.0, ())) == (True, ())


def test_read_leases_are_granted_only_while_the_artifact_is_recorded(make: Callable[[], MetadataBackend]) -> None:
    """A grant checks the record in the same transaction: once a delete removed it, no grant lands (so a delete
    that read the leases after removing the record has seen every one that can be used)."""
    b = make()
    assert not run(b.grant_read(A, "w0", 10.0))  # unknown artifact
    run(b.commit_artifact(artifact(A), "w0", None, None, 1.0))
    assert run(b.grant_read(A, "w0", 10.0)) and run(b.grant_read(A, "w1", 5.0))
    assert run(b.grant_read(A, "w0", 12.0))  # renewed: replaces the earlier end
    assert sorted(run(b.reads_of(A, 4.0))) == [("w0", 12.0), ("w1", 5.0)]
    assert run(b.reads_of(A, 5.0)) == [("w0", 12.0)]  # ended leases are not listed
    assert run(b.reads_of(B, 0.0)) == []
    run(b.delete_artifact(A, 6.0))
    assert not run(b.grant_read(A, "w2", 20.0))
    assert run(b.reads_of(A, 6.0)) == [("w0", 12.0)]  # still there to be revoked...
    run(b.commit_artifact(artifact(A), "w1", None, None, 7.0))  # put again meanwhile, and leased anew
    assert run(b.grant_read(A, "w1", 30.0))
    run(b.end_reads(A, [("w0", 12.0), ("w1", 5.0)]))
    assert run(b.reads_of(A, 6.0)) == [("w1", 30.0)]  # ...forgotten once it was; the new lease is kept


def test_replicas_and_restarts(make: Callable[[], MetadataBackend]) -> None:
    b = make()
    run(b.register_worker(worker("w0"), 1.0))
    assert not run(b.add_replica(A, "w0", ("memory",)))  # unknown artifact
    run(b.commit_artifact(artifact(A), "w0", None, None, 2.0, ("memory", "disk")))
    assert run(b.remove_replica(A, "w0", "disk")) is False  # the memory replica remains
    assert run(b.replicas_of(A)) == [("w0", "memory")]
    run(b.add_replica(A, "w0", ("disk",)))
    run(b.commit_artifact(artifact(B), "w0", None, None, 2.0, ("memory",)))
    # A restart loses memory replicas, keeps disk ones; B's only copy was in memory: reported, to reap.
    assert run(b.register_worker(worker("w0"), 3.0)) == (2, [B])
    assert run(b.replicas_of(A)) == [("w0", "disk")]
    assert run(b.remove_replica(A, "w0", "disk")) is True  # the last one


def test_a_copy_deleted_while_its_holder_was_away_is_not_restored(make: Callable[[], MetadataBackend]) -> None:
    b = make()
    run(b.register_worker(worker("w0"), 1.0))
    run(b.commit_artifact(artifact(A), "w0", "k", None, 1.0, ("disk",)))
    run(b.delete_artifact(A, 2.0, "its lease expired"))  # w0 is down: its drop stays pending
    inc, _ = run(b.register_worker(worker("w0"), 3.0))  # w0 restarts and announces its disk copy
    assert not run(b.add_replica(A, "w0", ("disk",), restored=True))
    assert not run(b.commit_artifact(artifact(A), "w0", None, None, 3.0, ("disk",), restored=True))
    assert run(b.get_artifact(A)) is None and run(b.tombstone(A)) == (A, "its lease expired")
    assert run(b.heartbeat("w0", inc, STATS, 4.0, ())) == (True, (A,))  # and it is told to drop it
    # Without any trace of it (a replaced database), a restored copy is recorded again.
    run(b.commit_artifact(artifact(B), "w0", None, None, 5.0, ("disk",), restored=True))
    assert run(b.get_artifact(B)) is not None
    # Put again by anyone: the tombstone goes.
    run(b.commit_artifact(artifact(A), "w1", "k", None, 6.0))
    assert run(b.tombstone(A)) is None and run(b.tombstone("k")) is None
    assert run(b.prune_tombstones(100.0)) == 0


def test_replica_goals_are_recorded_raised_and_listed(make: Callable[[], MetadataBackend]) -> None:
    b = make()
    c = "tc-" + "c" * 32
    run(b.commit_artifact(wanting(A, 2), "w0", "ka", None, 1.0))
    run(b.commit_artifact(artifact(B), "w0", None, None, 1.0))  # one copy wanted: not a goal
    run(b.commit_artifact(wanting(c, 2), "w1", None, None, 1.0))
    assert run(b.get_artifact(A)).info.replicas_wanted == 2 and run(b.get_artifact(B)).info.replicas_wanted == 1
    run(b.add_replica(A, "w1", ("memory",)))
    assert run(b.replica_goals("", "", 10)) == ([(A, 2, [("w0", "memory"), ("w1", "memory")]),
                                                 (c, 2, [("w1", "memory")])], "")
    assert run(b.replica_goals("w0", "", 10)) == ([(A, 2, [("w0", "memory"), ("w1", "memory")])], "")
    assert run(b.replica_goals("w9", "", 10)) == ([], "")
    page, cursor = run(b.replica_goals("", "", 1))
    assert [r[0] for r in page] == [A] and cursor
    assert [r[0] for r in run(b.replica_goals("", cursor, 1))[0]] == [c]
    # A put asking for fewer copies leaves the goal; one asking for more raises it.
    run(b.commit_artifact(artifact(A), "w2", None, None, 2.0))
    assert run(b.get_artifact(A)).info.replicas_wanted == 2
    run(b.commit_artifact(wanting(A, 3), "w0", None, None, 2.0))
    assert run(b.get_artifact(A)).info.replicas_wanted == 3
    # Deleted: no longer listed; the id put again afresh wants what that put asks for.
    run(b.delete_artifact(A, 3.0))
    assert [r[0] for r in run(b.replica_goals("", "", 10))[0]] == [c]
    run(b.commit_artifact(artifact(A), "w0", None, None, 4.0))
    assert run(b.get_artifact(A)).info.replicas_wanted == 1
    assert [r[0] for r in run(b.replica_goals("", "", 10))[0]] == [c]
    b2 = make()  # another store (or a restart) sees the goals
    assert run(b2.get_artifact(c)).info.replicas_wanted == 2


def test_instances(make: Callable[[], MetadataBackend]) -> None:
    b = make()
    info = InstanceInfo(instance_id="i0", address="127.0.0.1:9", home_worker="w0", engine="e")
    run(b.upsert_instance(info, 1.0))
    assert run(b.instance_heartbeat("i0", {"running": 3, "waiting": 1, "kv_tokens_used": 5,
                                           "kv_tokens_capacity": 9}, 2.0))
    assert not run(b.instance_heartbeat("i9", {}, 2.0))
    (got,) = run(b.list_instances())
    assert (got.running, got.waiting, got.kv_tokens_used, got.last_heartbeat, got.engine) == (3, 1, 5, 2.0, "e")


def test_shard_leases_and_page_index(make: Callable[[], MetadataBackend]) -> None:
    b = make()
    recs = [LeaseRecord(s, f"w{s % 2}", 1, 10.0 + s, 1.0) for s in range(4)]
    assert run(b.update_leases(range(4), lambda s, cur: recs[s])) == recs
    assert run(b.update_leases([2, 3], lambda s, cur: LeaseRecord(2, "w9", 2, 30.0, 5.0) if s == 2 else None)) \
        == [LeaseRecord(2, "w9", 2, 30.0, 5.0)]
    got = run(b.load_leases())
    assert got[2] == LeaseRecord(2, "w9", 2, 30.0, 5.0) and got[3] == recs[3] and len(got) == 4
    run(b.page_index_put(("k1", "k2"), "w0"))
    assert run(b.page_index_get(("k2", "k3"))) == ["w0", ""]


def test_big_updates_are_not_limited_by_one_transaction(make: Callable[[], MetadataBackend]) -> None:
    """etcd refuses a transaction of over 128 operations: a backend on it splits what a caller asks for in
    one call (lease updates over many shards, an artifact under many keys) without losing any of it."""
    b = make()
    shards = range(300)
    recs = [LeaseRecord(s, f"w{s % 3}", 1, 10.0 + s, 1.0) for s in shards]
    assert run(b.update_leases(shards, lambda s, cur: recs[s])) == recs
    assert run(b.load_leases()) == {r.shard: r for r in recs}
    keys = [f"alias/{i:03d}" for i in range(80)]
    for i, key in enumerate(keys):  # the same content put under 80 keys: one artifact
        run(b.commit_artifact(artifact(A), "w0", key, None, 1.0 + i))
    assert [k for k, _ in run(b.get_artifact(A)).refs.bindings] == keys
    assert run(b.unbind(A, keys[0], 100.0, "deleted")) == Unbound(False, keys=tuple(keys[1:]))  # one of them
    run(b.delete_artifact(A, 100.0))
    assert run(b.get_artifact(A)) is None
    assert all(run(b.resolve_key(k)) is None and run(b.tombstone(k)) == (A, "deleted") for k in keys)
    # 80 leases that ended and one permanent key: unbinding that key leaves nothing live, so all of it goes.
    for i, key in enumerate(keys):
        run(b.commit_artifact(artifact(B), "w0", key, 50.0, 1.0 + i))
    run(b.commit_artifact(artifact(B), "w0", "alias/keep", None, 2.0))
    assert run(b.unbind(B, "alias/keep", 60.0, "deleted")) == Unbound(True, ("w0",))
    assert run(b.get_artifact(B)) is None and run(b.expired_references(100.0)) == []
    assert all(run(b.resolve_key(k)) is None for k in [*keys, "alias/keep"])


def test_a_group_commit_records_each_as_one_commit_would(make: Callable[[], MetadataBackend]) -> None:
    b = make()
    run(b.register_worker(worker("w0"), 1.0))
    run(b.commit_artifact(artifact(C), "w0", None, None, 1.0, ("disk",)))
    run(b.delete_artifact(C, 2.0, "deleted"))  # w0 still owes its drop: a restored copy of C is refused
    group = [ArtifactCommit(artifact(A), "w0", "ka", None, ("memory",)),
             ArtifactCommit(artifact(B), "w1", "kb", 90.0, ("memory", "disk")),
             ArtifactCommit(artifact(C), "w0", None, None, ("disk",), restored=True),
             ArtifactCommit(artifact(A), "w1", None, None, ("memory",))]
    assert run(b.commit_artifacts(group, 3.0)) == [True, True, False, True]
    assert run(b.resolve_key("ka")) == (A, None) and run(b.resolve_key("kb")) == (B, 90.0)
    assert sorted(run(b.replicas_of(A))) == [("w0", "memory"), ("w1", "memory")]
    assert sorted(run(b.replicas_of(B))) == [("w1", "disk"), ("w1", "memory")]
    assert run(b.get_artifact(A)).refs == References((("ka", None),), anonymous=True, anon_expiry=None)
    assert run(b.get_artifact(C)) is None
    assert run(b.commit_artifacts([], 4.0)) == []
    run(b.close())
    again = make()  # acknowledged: all there after a reopen
    assert run(again.resolve_key("kb")) == (B, 90.0) and sorted(run(again.replicas_of(B)))[0] == ("w1", "disk")


def test_everything_acknowledged_survives_a_reopen(make: Callable[[], MetadataBackend]) -> None:
    b = make()
    inc, _ = run(b.register_worker(worker("w0"), 1.0))
    run(b.commit_artifact(artifact(A), "w0", "k", 99.0, 2.0, ("disk",)))
    run(b.commit_artifact(artifact(A), "w0", None, 98.0, 2.0, ("disk",)))
    run(b.update_leases([0], lambda s, cur: LeaseRecord(0, "w0", 3, 10.0, 1.0)))
    run(b.close())
    again = make()
    assert run(again.resolve_key("k")) == (A, 99.0)
    assert run(again.get_artifact(A)).refs == References((("k", 99.0),), anonymous=True, anon_expiry=98.0)
    assert run(again.replicas_of(A)) == [("w0", "disk")]
    assert run(again.load_leases())[0].token == 3
    assert run(again.register_worker(worker("w0"), 3.0))[0] == inc + 1


def test_two_stores_granting_one_shard_cannot_both_win(make: Callable[[], MetadataBackend]) -> None:
    """Two global-store processes (two backends on the same data) race to grant shard 0 to different
    workers: each grant is a compare-and-swap, so every token is handed out once and tokens only grow."""
    first, second = make(), make()
    won: list[tuple[str, int]] = []

    def grant_to(worker: str) -> Callable[[int, LeaseRecord | None], LeaseRecord | None]:
        def change(s: int, cur: LeaseRecord | None) -> LeaseRecord | None:
            if cur is not None and cur.holder:
                return None  # held: this request loses
            return LeaseRecord(s, worker, (cur.token if cur else 0) + 1, 99.0, 1.0)
        return change

    async def race(rounds: int) -> None:
        for i in range(rounds):
            results = await asyncio.gather(first.update_leases([0], grant_to(f"a{i}")),
                                           second.update_leases([0], grant_to(f"b{i}")))
            winners = [r[0] for r in results if r]
            assert len(winners) == 1, results
            won.append((winners[0].holder, winners[0].token))
            await first.update_leases([0], lambda s, cur: None if cur is None else
                                      LeaseRecord(s, "", cur.token, 0.0, cur.acquired_at))  # released

    run(race(10))
    assert [t for _, t in won] == list(range(1, 11))
    assert run(second.load_leases()).get(0) is not None or run(first.load_leases())[0].token == 10


def test_live_global_stores_are_listed(make: Callable[[], MetadataBackend]) -> None:
    b = make()
    run(b.announce_store("10.0.0.1:7070", "http://10.0.0.1:9400", 30.0))
    run(b.announce_store("10.0.0.2:7070", "", 30.0))
    run(b.announce_store("10.0.0.1:7070", "http://10.0.0.1:9400", 30.0))  # again: refreshed, not doubled
    import time

    assert run(b.list_stores(time.time())) == {"10.0.0.1:7070": "http://10.0.0.1:9400", "10.0.0.2:7070": ""}
