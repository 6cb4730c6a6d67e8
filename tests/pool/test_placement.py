from __future__ import annotations

import math

import pytest

from tensorcast.errors import InvalidArgument, ResourceExhausted
from tensorcast.pool.placement import (
    PRESETS,
    Placement,
    PutDecision,
    Repair,
    decide_put,
    plan_repairs,
    replica_candidates,
    replica_targets,
    resolve_placement,
)
from tensorcast.pool.state import MemoryReplica, PoolState
from tensorcast.records import ArtifactInfo, ReplicaInfo, WorkerInfo


def test_presets_and_their_promises() -> None:
    assert resolve_placement(None).name == "cache"
    assert set(PRESETS) == {"cache", "durable", "ha", "cold", "warm", "pinned"}
    assert resolve_placement("durable").disk == "required"
    assert resolve_placement("ha").replicas == 2
    assert resolve_placement("warm").overflow == "reject" and resolve_placement("warm").evictable
    assert not resolve_placement("pinned").evictable and resolve_placement("pinned").memory == "required"
    assert resolve_placement("cold", cold_memory_ttl=5.0).memory_ttl == 5.0
    with pytest.raises(InvalidArgument, match="presets"):
        resolve_placement("fast")


@pytest.mark.parametrize("bad", [
    Placement(memory="none", disk="none"),
    Placement(replicas=0),
    Placement(memory="none", disk="required", replicas=2),
    Placement(memory="required", overflow="spill"),
    Placement(memory_ttl=5.0),
    Placement(overflow="later"),  # type: ignore[arg-type]
])
def test_general_form_is_validated(bad: Placement) -> None:
    with pytest.raises(InvalidArgument):
        resolve_placement(bad)


# ----------------------------------------------------------------- decisions (pure: no worker, no clock)

MiB = 1 << 20


def _state(capacity: int, replicas: dict[str, tuple[int, float]], pinned: frozenset[str] = frozenset()) -> PoolState:
    """A pool holding one blob per replica: ``{artifact: (bytes, last access)}``."""
    state = PoolState(capacity)
    for aid, (size, last) in replicas.items():
        state.reserve(size)
        state.commit_blob(aid + "-blob", size)
        state.add_replica(MemoryReplica(aid, (aid + "-blob",), last_access=last,
                                        pinned_until=math.inf if aid in pinned else None))
    return state


def test_a_put_that_fits_goes_to_memory_and_evicts_nothing() -> None:
    d = decide_put(PRESETS["cache"], _state(10 * MiB, {"a": (2 * MiB, 1.0)}), 4 * MiB, 5.0, (), has_disk=False)
    assert d == PutDecision(to_memory=True, to_disk=False)
    d = decide_put(PRESETS["durable"], _state(10 * MiB, {}), MiB, 5.0, ("disk",), has_disk=True)
    assert d == PutDecision(to_memory=True, to_disk=False)  # the disk copy is already here
    assert decide_put(PRESETS["cache"], _state(MiB, {}), 0, 0.0, ("memory",), has_disk=False) == \
        PutDecision(False, False)  # every copy the placement wants is here: nothing to write


def test_a_full_pool_evicts_least_recently_used_unpinned_replicas() -> None:
    state = _state(10 * MiB, {"old": (4 * MiB, 1.0), "pinned": (3 * MiB, 0.5), "new": (3 * MiB, 9.0)},
                   pinned=frozenset({"pinned"}))
    d = decide_put(PRESETS["cache"], state, 4 * MiB, 10.0, (), has_disk=False)
    assert d == PutDecision(True, False, ("old",))
    d = decide_put(PRESETS["cache"], state, 7 * MiB, 10.0, (), has_disk=False)
    assert d.evict == ("old", "new")
    assert state.used == 10 * MiB  # deciding changed nothing


def test_when_eviction_is_not_enough_durable_spills_and_cache_refuses() -> None:
    state = _state(10 * MiB, {"pinned": (8 * MiB, 0.5)}, pinned=frozenset({"pinned"}))
    assert decide_put(PRESETS["durable"], state, 4 * MiB, 1.0, (), has_disk=True) == PutDecision(False, True)
    assert decide_put(PRESETS["cold"], state, 4 * MiB, 1.0, (), has_disk=True) == PutDecision(False, True)
    for name in ("cache", "warm", "pinned"):
        with pytest.raises(ResourceExhausted):
            decide_put(PRESETS[name], state, 4 * MiB, 1.0, (), has_disk=True)
    with pytest.raises(InvalidArgument, match="disk tier"):
        decide_put(PRESETS["durable"], state, 4 * MiB, 1.0, (), has_disk=False)


def test_reject_and_spill_never_evict() -> None:
    state = _state(10 * MiB, {"a": (8 * MiB, 1.0)})
    with pytest.raises(ResourceExhausted, match="may not evict or spill"):
        decide_put(PRESETS["warm"], state, 4 * MiB, 2.0, (), has_disk=True)
    spill = Placement(overflow="spill")
    with pytest.raises(InvalidArgument, match="spilling needs a disk tier"):
        decide_put(spill, state, 4 * MiB, 2.0, (), has_disk=False)
    assert decide_put(spill, state, 4 * MiB, 2.0, (), has_disk=True) == PutDecision(False, True)


def test_extra_replicas_go_to_other_hosts_first_then_the_least_full() -> None:
    def w(wid: str, host: str, used: int, alive: bool = True) -> WorkerInfo:
        return WorkerInfo(worker_id=wid, address="", host_id=host, roles=("basic",), memory_used=used,
                          memory_capacity=100, alive=alive)

    workers = [w("self", "h0", 0), w("same-host", "h0", 0), w("far-full", "h1", 90), w("far-empty", "h2", 10),
               w("far-dead", "h3", 0, alive=False)]
    assert replica_targets(workers, "self", "h0", 1) == ["far-empty"]
    assert replica_targets(workers, "self", "h0", 3) == ["far-empty", "far-full", "same-host"]
    assert replica_targets(workers, "self", "h0", 0) == []


def _w(wid: str, host: str, used: int = 0, alive: bool = True) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, address="", host_id=host, roles=("basic",), memory_used=used,
                      memory_capacity=100, alive=alive)


@pytest.mark.parametrize("holders,want", [
    ({"a": "h0"}, ["c", "e", "b", "d"]),  # h1 and h2 before h0; then each host's second worker, least full first
    ({"a": "h0", "c": "h1"}, ["e", "b", "d"]),  # the host without a copy first
    ({}, ["a", "c", "e", "b", "d"]),  # nobody holds it yet: one per host first
    ({"a": "h0", "b": "h0", "c": "h1", "d": "h1", "e": "h2"}, []),  # every live worker holds it
])
def test_candidates_spread_copies_over_hosts(holders: dict[str, str], want: list[str]) -> None:
    workers = [_w("a", "h0"), _w("b", "h0", 50), _w("c", "h1", 10), _w("d", "h1", 60), _w("e", "h2", 20),
               _w("dead", "h3", 0, alive=False)]
    assert replica_candidates(workers, holders) == want


def test_planned_bytes_count_against_a_candidate() -> None:
    workers = [_w("a", "h0"), _w("b", "h1", 10), _w("c", "h1", 20)]
    assert replica_candidates(workers, {"a": "h0"})[0] == "b"
    assert replica_candidates(workers, {"a": "h0"}, {"b": 30})[0] == "c"


def _art(aid: str, holders: list[str], wanted: int = 2, nbytes: int = 10) -> ArtifactInfo:
    return ArtifactInfo(id=aid, tensors=(), nbytes=nbytes, replicas_wanted=wanted,
                        replicas=tuple(ReplicaInfo(worker_id=h) for h in holders))


# (artifacts, dead workers, busy, avoid) -> the copies to make
REPAIRS = [
    ("one copy lost: its other holder copies it to another host",
     [_art("x", ["w0", "w1"])], {"w1"}, (), {}, [Repair("x", "w0", "w2")]),
    ("the lowest-id live holder is responsible",
     [_art("x", ["w3", "w1", "w0"], wanted=4)], {"w0"}, (), {}, [Repair("x", "w1", "w2"), Repair("x", "w1", "w4")]),
    ("enough live copies: nothing", [_art("x", ["w0", "w2"])], {"w1"}, (), {}, []),
    ("no live holder: nothing to copy from", [_art("x", ["w1"])], {"w1"}, (), {}, []),
    ("copies being made already: nothing", [_art("x", ["w0", "w1"])], {"w1"}, {"x"}, {}, []),
    ("a target that failed is avoided until its time",
     [_art("x", ["w0", "w1"])], {"w1"}, (), {("x", "w2"): 200.0}, [Repair("x", "w0", "w3")]),
    ("an avoidance that ended no longer counts",
     [_art("x", ["w0", "w1"])], {"w1"}, (), {("x", "w2"): 50.0}, [Repair("x", "w0", "w2")]),
    ("three wanted, two lost: two targets on distinct hosts",
     [_art("x", ["w0", "w1", "w2"], wanted=3)], {"w1", "w2"}, (), {},
     [Repair("x", "w0", "w3"), Repair("x", "w0", "w4")]),
    ("copies planned for one artifact steer the next one's target",
     [_art("x", ["w0", "w1"]), _art("y", ["w0", "w1"])], {"w1"}, (), {},
     [Repair("x", "w0", "w2"), Repair("y", "w0", "w3")]),
    ("nowhere to go: fewer copies", [_art("x", ["w0", "w1", "w2", "w3", "w4"], wanted=6)], set(), (), {}, []),
]


@pytest.mark.parametrize("artifacts,dead,busy,avoid,want", [r[1:] for r in REPAIRS], ids=[r[0] for r in REPAIRS])
def test_plan_repairs(artifacts: list[ArtifactInfo], dead: set[str], busy: tuple[str, ...],
                      avoid: dict[tuple[str, str], float], want: list[Repair]) -> None:
    # w0, w1 on h0; w2 on h1; w3 on h2; w4 on h3; all equally empty.
    hosts = {"w0": "h0", "w1": "h0", "w2": "h1", "w3": "h2", "w4": "h3"}
    workers = [_w(wid, host, alive=wid not in dead) for wid, host in hosts.items()]
    assert plan_repairs(artifacts, workers, 100.0, busy=busy, avoid=avoid) == want
