"""The rebalancer's decisions on hand-made signals (gap, hysteresis, cooldown, busy sessions, no oscillation)
and the plan one move becomes (built without a cluster)."""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tensorcast import CallContext, Plan, PlanOutcome
from tensorcast.errors import InvalidArgument
from tensorcast.policies import Move, MoveSession, Rebalancer, SessionInfo, SessionTable, build_move
from tensorcast.records import InstanceInfo, StepResult
from tensorcast.wire.messages import PlanResult, RunPlan

DOCS = Path(__file__).resolve().parents[2] / "docs" / "policies.md"


def inst(iid: str, running: int = 0, kv_used: int = 0, kv_cap: int = 0, alive: bool = True) -> InstanceInfo:
    return InstanceInfo(instance_id=iid, address=f"{iid}:1", home_worker=f"w-{iid}", running=running,
                        kv_tokens_used=kv_used, kv_tokens_capacity=kv_cap, alive=alive)


def sess(sid: str, on: str, kv: int = 100, busy: bool = False) -> SessionInfo:
    return SessionInfo(sid, on, kv, busy)


def on(instance: str, n: int, prefix: str = "", busy: bool = False) -> list[SessionInfo]:
    """``n`` sessions of 1 KV token on ``instance``."""
    return [sess(f"{prefix or instance}{k}", instance, 1, busy) for k in range(n)]


def test_no_move_while_the_gap_is_within_bounds() -> None:
    r = Rebalancer(interval_s=1.0, gap=4)
    assert r.decide(0.0, [inst("a"), inst("b")], on("a", 6) + on("b", 2)) == []  # 6 - 2 = 4, not > 4


def test_idle_sessions_are_load_and_a_momentary_burst_is_not() -> None:
    # Every session idle: running + waiting is 0 everywhere, yet a holds 6 sessions and b none.
    (m, n) = Rebalancer(gap=1).decide(0.0, [inst("a"), inst("b")], on("a", 6))
    assert (m.source, m.target, n.source, n.target) == ("a", "b", "a", "b")
    # a is busy right now, but the sessions are spread evenly: nothing to fix.
    assert Rebalancer(gap=0).decide(0.0, [inst("a", 20), inst("b", 0)], on("a", 3) + on("b", 3)) == []


def test_moves_idle_sessions_with_most_kv_first_from_most_to_least_loaded() -> None:
    r = Rebalancer(interval_s=1.0, gap=2, max_moves_per_tick=2)
    sessions = [sess("small", "a", 10), sess("big", "a", 900), sess("busy", "a", 5000, busy=True),
                sess("mid", "a", 500), *on("a", 4, "fill"), *on("b", 3), sess("elsewhere", "c", 9000)]
    moves = r.decide(5.0, [inst("a", 12), inst("b", 6), inst("c", 1)], sessions)  # 8 / 3 / 1 sessions
    assert [(m.session_id, m.source, m.target) for m in moves] == [("big", "a", "c"), ("mid", "a", "c")]
    assert moves[0] == Move("big", "a", "c", 900, "big", 5.0)


def test_a_busy_session_never_moves() -> None:
    r = Rebalancer(interval_s=0.0, gap=0, max_moves_per_tick=5)
    for t in range(20):
        assert r.decide(float(t), [inst("a", 50), inst("b", 0)], on("a", 10, busy=True)) == []


def test_ticks_are_spaced_by_the_interval() -> None:
    r = Rebalancer(interval_s=2.0, gap=0, max_moves_per_tick=1, cooldown_s=0.0)
    instances = [inst("a", 10), inst("b", 0)]
    sessions = [sess(f"s{i}", "a") for i in range(5)]
    assert len(r.decide(10.0, instances, sessions)) == 1
    assert r.decide(11.9, instances, sessions) == []
    assert len(r.decide(12.0, instances, sessions)) == 1


def test_a_move_that_would_invert_the_imbalance_is_not_made() -> None:
    pair = [inst("a"), inst("b")]
    # gap 0: 1 vs 0 sessions exceeds the gap, but moving it would leave 0 vs 1.
    assert Rebalancer(gap=0, max_moves_per_tick=9).decide(0.0, pair, on("a", 1)) == []
    # 3 vs 0: one move (2 vs 1); a second would make it 1 vs 2.
    assert len(Rebalancer(gap=0, max_moves_per_tick=9).decide(0.0, pair, on("a", 3))) == 1
    # 4 vs 0: two moves reach 2 vs 2 and the gap is closed.
    assert len(Rebalancer(gap=0, max_moves_per_tick=9).decide(0.0, pair, on("a", 4))) == 2


def test_cooldown_keeps_a_moved_session_put() -> None:
    r = Rebalancer(interval_s=0.0, gap=0, max_moves_per_tick=1, cooldown_s=30.0)
    (m,) = r.decide(0.0, [inst("a"), inst("b")], [sess("s1", "a"), sess("s2", "a", 50)])
    assert (m.session_id, m.target) == ("s1", "b")
    # The load turned around: b now holds s1 and two busy sessions, a none; s1 moved less than 30 s ago.
    back = [sess("s1", "b"), *on("b", 2, "x", busy=True)]
    assert r.decide(10.0, [inst("a"), inst("b")], back) == []
    assert r.decide(29.9, [inst("a"), inst("b")], back) == []
    (again,) = r.decide(30.0, [inst("a"), inst("b")], back)
    assert (again.session_id, again.source, again.target, again.decided_at) == ("s1", "b", "a", 30.0)


def test_target_without_room_for_the_kv_gets_a_smaller_session() -> None:
    r = Rebalancer(gap=0, max_moves_per_tick=3)
    instances = [inst("a", 10, 5000, 10_000), inst("b", 0, 9_500, 10_000)]  # b has 500 tokens free
    sessions = [sess("huge", "a", 4000), sess("fits-1", "a", 300), sess("fits-2", "a", 300),
                *on("a", 4, busy=True)]
    moves = r.decide(0.0, instances, sessions)
    assert [m.session_id for m in moves] == ["fits-1"]  # a second 300 would not fit any more


def test_no_move_toward_an_instance_busier_now_than_the_source() -> None:
    sessions = on("a", 6)  # a holds 6 idle sessions, b none
    # b serves 3 requests right now, a none: a load-aware router would not send a's next turn to b.
    assert Rebalancer(gap=1).decide(0.0, [inst("a", 0), inst("b", 3)], sessions) == []
    # as busy in requests, but b holds more KV in flight (least_loaded's tie-break): still not.
    assert Rebalancer(gap=1).decide(0.0, [inst("a", 1, 10), inst("b", 1, 500)], sessions) == []
    # b no busier than a: the moves go ahead.
    assert len(Rebalancer(gap=1).decide(0.0, [inst("a", 2, 10), inst("b", 2, 10)], sessions)) == 2


def test_dead_instances_are_neither_sources_nor_targets() -> None:
    r = Rebalancer(gap=0, max_moves_per_tick=3)
    instances = [inst("a", 50, alive=False), inst("b", 9), inst("c", 0, alive=False), inst("d", 1)]
    moves = r.decide(0.0, instances, [*on("a", 5), sess("y", "b"), sess("z", "b")])
    assert {(m.source, m.target) for m in moves} == {("b", "d")}


def _apply(sessions: list[SessionInfo], moves: Sequence[Move]) -> list[SessionInfo]:
    where = {m.session_id: m.target for m in moves}
    return [replace(s, instance_id=where.get(s.session_id, s.instance_id)) for s in sessions]


def test_never_oscillates_on_a_steady_imbalance() -> None:
    """The moves never take effect (every plan fails), so the imbalance stays for 1000 ticks: sessions
    only ever leave a for b, and each session at most once per cooldown."""
    r = Rebalancer(interval_s=0.5, gap=2, max_moves_per_tick=2, cooldown_s=5.0)
    sessions = [*on("a", 20), *on("b", 0), *on("c", 4)]
    moved: list[Move] = []
    for tick in range(1000):
        moved += r.decide(tick * 0.25, [inst("a"), inst("b"), inst("c")], sessions)
    assert moved and all(m.source == "a" and m.target == "b" for m in moved)
    last: dict[str, float] = {}
    for m in moved:
        assert m.decided_at >= last.get(m.session_id, -math.inf) + 5.0
        last[m.session_id] = m.decided_at


def test_converges_from_a_pile_up_and_no_session_moves_twice() -> None:
    r = Rebalancer(interval_s=0.5, gap=2, max_moves_per_tick=2, cooldown_s=5.0)
    sessions = [sess(f"s{i}", "a" if i < 20 else "c", kv=i) for i in range(24)]
    moved: list[Move] = []
    for tick in range(1000):
        moves = r.decide(tick * 0.25, [inst("a", 20), inst("b", 0), inst("c", 4)], sessions)
        moved += moves
        sessions = _apply(sessions, moves)
    counts = {iid: sum(s.instance_id == iid for s in sessions) for iid in "abc"}
    assert max(counts.values()) - min(counts.values()) <= 2, counts
    assert moved and all(m.source == "a" for m in moved)
    assert len({m.session_id for m in moved}) == len(moved)


def test_closed_loop_converges_without_moving_anyone_back() -> None:
    """Each session is one unit of load: moves stop within the gap, and no session ever returns to an
    instance it left."""
    r = Rebalancer(interval_s=1.0, gap=1, max_moves_per_tick=3, cooldown_s=4.0)
    sessions = [sess(f"s{i}", "a" if i < 24 else "b", kv=i * 7 % 50) for i in range(30)]
    history: dict[str, list[str]] = {s.session_id: [s.instance_id] for s in sessions}
    last_move = -1
    for tick in range(200):
        busy = {s.session_id for s in sessions[tick % 5::5]}  # a fifth of them mid-turn at any tick
        seen = [replace(s, busy=s.session_id in busy) for s in sessions]
        moves = r.decide(float(tick), [inst(i) for i in "abcd"], seen)
        for m in moves:
            assert m.session_id not in busy
            history[m.session_id].append(m.target)
            last_move = tick
        sessions = _apply(sessions, moves)
    counts = {iid: sum(s.instance_id == iid for s in sessions) for iid in "abcd"}
    assert max(counts.values()) - min(counts.values()) <= 1, counts
    assert last_move < 50
    assert all(len(set(path)) == len(path) for path in history.values()), history


def test_bad_settings_are_refused() -> None:
    for kw in ({"interval_s": -1.0}, {"gap": -1}, {"max_moves_per_tick": 0}, {"cooldown_s": -0.1}):
        with pytest.raises(InvalidArgument):
            Rebalancer(**kw)


def test_docs_show_the_rebalancer_whole() -> None:
    source = inspect.getsource(Rebalancer)
    assert len(source.splitlines()) <= 60
    assert source in DOCS.read_text(encoding="utf-8")


# ----------------------------------------------------------------------------- the move's plan


class FakeOperation:
    def __init__(self, outcome: PlanOutcome) -> None:
        self.outcome = outcome

    def result(self, timeout: float | None = None) -> PlanOutcome:
        return self.outcome


class FakeClient:
    """A plan builder whose submissions are recorded and answered with a fixed status."""

    def __init__(self, status: str = "succeeded") -> None:
        self.status = status
        self.submitted: list[tuple[RunPlan, CallContext]] = []

    def plan(self, ctx: CallContext | None = None) -> Plan:
        return Plan(ctx or CallContext(), self.submit)

    def submit(self, spec: RunPlan, ctx: CallContext) -> Any:
        self.submitted.append((spec, ctx))
        steps = tuple(StepResult(id=s.id, op=s.op, status=self.status) for s in spec.steps)
        return FakeOperation(PlanOutcome(PlanResult(plan_id="p1", status=self.status, steps=steps)))


MOVE = Move("sess-1", "inst-a", "inst-b", 4096, "sess-1/7", 12.5)
INSTANCES = [inst("inst-a"), inst("inst-b")]


def test_a_move_is_one_plan_publish_prefetch_to_target_home_hydrate() -> None:
    client = FakeClient()
    plan, steps = MoveSession(client, SessionTable(), timeout=30.0).plan(MOVE, INSTANCES)
    spec = plan.spec()
    assert [s.op for s in spec.steps] == ["publish", "prefetch", "hydrate"]
    pub, pre, hyd = spec.steps
    assert (pub.id, pre.id, hyd.id) == (steps.publish.id, steps.prefetch.id, steps.hydrate.id)
    assert pub.args == {"instance": "inst-a", "request_id": "sess-1/7"}
    assert pre.args == {"artifacts": {"$ref": pub.id}, "to": "w-inst-b"}
    assert hyd.args == {"instance": "inst-b", "request_id": "sess-1/7", "artifacts": {"$ref": pub.id}}
    assert hyd.after == (pre.id,)
    key = plan.ctx.idempotency_key or ""
    assert "sess-1" in key and "12.5" in key and plan.ctx.deadline is not None
    other = MoveSession(client, SessionTable()).plan(replace(MOVE, decided_at=99.0), INSTANCES)[0]
    assert other.ctx.idempotency_key != key  # a later decision is a new plan, not a reuse of this one


def test_build_move_adds_to_any_plan() -> None:
    plan = Plan(CallContext(), lambda spec, ctx: None)
    plan.wait(0.0)
    steps = build_move(plan, MOVE, "w9")
    assert [s.op for s in plan.steps] == ["wait", "publish", "prefetch", "hydrate"]
    assert steps.prefetch.args["to"] == "w9"


def test_the_session_is_rerouted_only_when_the_plan_succeeded() -> None:
    table = SessionTable()
    table.assign("sess-1", "inst-a")
    failed = MoveSession(FakeClient("failed"), table).run(MOVE, INSTANCES)
    assert not failed.ok and table.get("sess-1") == "inst-a"
    client = FakeClient()
    done = MoveSession(client, table).run(MOVE, INSTANCES)
    assert done.ok and table.get("sess-1") == "inst-b"
    (spec, ctx), = client.submitted
    assert spec.idempotency_key == ctx.idempotency_key is not None


def test_a_move_to_an_unknown_instance_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="inst-z"):
        MoveSession(FakeClient(), SessionTable()).plan(replace(MOVE, target="inst-z"), INSTANCES)
