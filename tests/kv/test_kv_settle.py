"""When the shard table has settled (``kv.settle``), table-driven: the rule ``LocalCluster.start()`` and
``add_worker`` wait for."""

from __future__ import annotations

import pytest

from tensorcast.kv.hrw import assignment
from tensorcast.kv.settle import live_homes, settled, unsettled
from tensorcast.records import ShardLease, WorkerInfo

NOW = 1000.0
TTL = 3.0
HOME = ("basic", "gateway", "shard-home")


def _worker(wid: str, age: float = 0.5, roles: tuple[str, ...] = HOME) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, address="", host_id="h", roles=roles, last_heartbeat=NOW - age)


def _table(num_shards: int, homes: list[str], *, expiry: float = NOW + 2,
           override: dict[int, tuple[str, float]] | None = None, missing: tuple[int, ...] = ()) -> list[ShardLease]:
    """Every shard held by its HRW home among ``homes`` until ``expiry``, except ``override`` and ``missing``."""
    want = assignment(num_shards, homes)
    out = []
    for shard in range(num_shards):
        if shard in missing:
            continue
        holder, until = (override or {}).get(shard, (want[shard], expiry))
        out.append(ShardLease(shard=shard, holder=holder, token=1, expiry=until))
    return out


@pytest.mark.parametrize(("workers", "want"), [
    ([_worker("w0"), _worker("w1")], ["w0", "w1"]),
    ([_worker("w1"), _worker("w0")], ["w0", "w1"]),                       # sorted
    ([_worker("w0"), _worker("w1", age=TTL + 0.1)], ["w0"]),              # heartbeat older than a lease TTL
    ([_worker("w0"), _worker("w1", age=TTL)], ["w0"]),                    # exactly a TTL: not live (as kv.home)
    ([_worker("w0"), _worker("gw", roles=("basic", "gateway"))], ["w0"]),  # not a shard home
    ([], []),
])
def test_live_homes_are_shard_homes_heartbeating_within_a_lease_ttl(workers: list[WorkerInfo],
                                                                     want: list[str]) -> None:
    assert live_homes(workers, NOW, TTL) == want


HOMES = ["w0", "w1", "w2"]
_want = assignment(16, HOMES)
_other = {s: next(h for h in HOMES if h != _want[s]) for s in range(16)}


@pytest.mark.parametrize(("case", "leases", "homes", "left"), [
    ("every shard on its HRW home", _table(16, HOMES), HOMES, []),
    ("one shard never leased", _table(16, HOMES, missing=(3,)), HOMES, [3]),
    ("one lease vacant", _table(16, HOMES, override={5: ("", NOW + 2)}), HOMES, [5]),
    ("one lease expired", _table(16, HOMES, override={7: (_want[7], NOW - 0.1)}), HOMES, [7]),
    ("one lease expiring now", _table(16, HOMES, override={7: (_want[7], NOW)}), HOMES, [7]),
    ("one shard on a live home that is not rank 0", _table(16, HOMES, override={2: (_other[2], NOW + 2)}),
     HOMES, [2]),
    ("held by the homes of before a join", _table(16, ["w0", "w1"]), HOMES,
     sorted(s for s in range(16) if _want[s] == "w2")),
    ("no live home", _table(16, HOMES), [], list(range(16))),
    ("no shards", [], HOMES, []),
])
def test_unsettled_shards(case: str, leases: list[ShardLease], homes: list[str], left: list[int]) -> None:
    num_shards = 16 if case != "no shards" else 0
    assert unsettled(num_shards, leases, homes, NOW) == left, case


def test_settled_counts_only_live_homes() -> None:
    workers = [_worker("w0"), _worker("w1"), _worker("w2", age=10.0)]  # w2 is dead: its shards belong elsewhere
    assert settled(16, _table(16, ["w0", "w1"]), workers, NOW, TTL)
    assert "w2" in _want.values()  # so a table that gives it shards is not settled while it is dead
    assert not settled(16, _table(16, HOMES), workers, NOW, TTL)
    assert not settled(16, _table(16, ["w0", "w1"]), [_worker("w0"), _worker("w1"), _worker("w2")], NOW, TTL)
