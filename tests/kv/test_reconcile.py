"""The shard home's lease loop as a pure decision (``kv.reconcile``), table-driven."""

from __future__ import annotations

import pytest

from tensorcast.kv.hrw import candidates
from tensorcast.kv.leases import HeldShard, HomeLeases, LeaseRecord
from tensorcast.kv.reconcile import EXPIRED, OTHER_HOLDER, Plan, reconcile

HOMES = ["a", "b", "c"]
N = 12
RANK0 = {s: candidates(s, HOMES, 1)[0] for s in range(N)}
MINE = [s for s in range(N) if RANK0[s] == "a"]
THEIRS = [s for s in range(N) if RANK0[s] != "a"]


def home(*held: tuple[int, int, float]) -> HomeLeases:
    return HomeLeases("a", held={s: HeldShard(token, until) for s, token, until in held})


def table(**recs: tuple[str, int, float]) -> dict[int, LeaseRecord]:
    out = {s: LeaseRecord(s, RANK0[s], 1, expiry=100.0) for s in range(N)}
    out.update({int(k[1:]): LeaseRecord(int(k[1:]), *v) for k, v in recs.items()})
    return out


def test_a_settled_home_renews_what_it_holds_and_asks_for_nothing() -> None:
    leases = home(*[(s, 1, 50.0) for s in MINE])
    plan = reconcile(leases, table(), HOMES, N, gs_now=10.0, now=10.0, grace=0.25)
    assert plan == Plan((), (), tuple(MINE), ())


@pytest.mark.parametrize(("held", "recs", "want_step"), [
    ((MINE[0], 1, 9.0), {}, [(MINE[0], EXPIRED)]),  # ran out here: before anything is sent
    ((MINE[0], 1, 50.0), {f"s{MINE[0]}": ("b", 2, 100.0)}, [(MINE[0], OTHER_HOLDER)]),  # granted elsewhere
    ((MINE[0], 1, 50.0), {f"s{MINE[0]}": ("a", 2, 100.0)}, [(MINE[0], OTHER_HOLDER)]),  # a newer token of its own
    ((MINE[0], 1, 50.0), {f"s{MINE[0]}": ("", 1, 0.0)}, [(MINE[0], OTHER_HOLDER)]),  # released meanwhile
])
def test_every_step_down_says_why(held: tuple[int, int, float], recs: dict[str, tuple[str, int, float]],
                                  want_step: list[tuple[int, str]]) -> None:
    plan = reconcile(home(held), table(**recs), HOMES, N, gs_now=10.0, now=10.0, grace=0.25)
    assert list(plan.step_down) == want_step and held[0] not in plan.renew


def test_shards_a_better_home_should_hold_are_given_back_not_renewed() -> None:
    theirs = THEIRS[0]
    leases = home((theirs, 3, 50.0))
    plan = reconcile(leases, table(**{f"s{theirs}": ("a", 3, 100.0)}), HOMES, N, gs_now=10.0, now=10.0, grace=0.25)
    assert plan.give_back == (theirs,) and plan.renew == () and plan.step_down == ()


def test_vacant_shards_it_ranks_first_for_are_asked_for_and_others_only_after_a_grace() -> None:
    mine, theirs = MINE[0], THEIRS[0]
    recs = {f"s{mine}": ("", 4, 0.0), f"s{theirs}": (RANK0[theirs], 2, 9.9)}
    plan = reconcile(home(), table(**recs), HOMES, N, gs_now=10.0, now=10.0, grace=0.25)
    assert plan.acquire == (mine,)
    alone = [h for h in HOMES if h != RANK0[theirs]]  # its holder died: no longer among the live homes
    plan = reconcile(home(), table(**recs), alone, N, gs_now=10.0, now=10.0, grace=0.25)
    assert theirs in plan.acquire or candidates(theirs, alone, 1)[0] != "a"
    # Just after a cut-off from the store: another live home's expired shard is left to it.
    held_long_expired = {f"s{theirs}": (RANK0[theirs], 2, 5.0)}
    assert theirs not in reconcile(home(), table(**held_long_expired), HOMES, N, gs_now=10.0, now=10.0,
                                   grace=0.25, takeover=False).acquire
