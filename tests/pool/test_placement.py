from __future__ import annotations

import math

import pytest

from tensorcast.errors import InvalidArgument, ResourceExhausted
from tensorcast.pool.placement import PRESETS, Placement, PutDecision, decide_put, replica_targets, resolve_placement
from tensorcast.pool.state import MemoryReplica, PoolState
from tensorcast.records import WorkerInfo


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
