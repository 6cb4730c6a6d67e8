"""The rebalancer live: real signals from two HF instance processes, a move decided on them and run as one plan,
and the moved session continuing on its new instance exactly as it would have without the move."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

import tensorcast as tc
from tensorcast.cluster import LocalCluster
from tensorcast.policies import LoadAwareShared, MoveSession, Rebalancer, Request, SessionInfo, StickySessions
from tensorcast.testing import running_cluster
from tensorcast.workloads import AgentWorkload


@pytest.fixture(scope="module")
def engines() -> Iterator[LocalCluster]:
    with running_cluster(workers=2) as cluster:
        cluster.start_instance("inst-a", "w0", ["--seed", "0"])
        cluster.start_instance("inst-b", "w1", ["--seed", "0"])  # the same weights: a second replica
        yield cluster


def _engine(c: tc.Client, inst: str, command: str, **args: object) -> dict:
    return c.call_instance(inst, "engine", args={"command": command, **args}).result


def test_a_rebalancing_move_keeps_the_sessions_next_output(engines: LocalCluster) -> None:
    work = AgentWorkload(gaps="fast", system_tokens=24, tool_tokens=16, scale=1.0, vocab_size=256, seed=3)
    sessions = [work.session(i) for i in range(3)]
    with tc.connect(engines.address) as c:
        router = StickySessions(LoadAwareShared())
        pile = [i for i in c.list_instances() if i.instance_id == "inst-a"]  # every first turn lands on inst-a
        for s in sessions:
            turn = s.turns[0]
            assert router.route(Request(s.session_id, turn.prompt), pile) == "inst-a"
            _engine(c, "inst-a", "prefill", request_id=turn.request_id, input_ids=turn.prompt.tolist())

        # The signals catch up with the next instance heartbeats (bounded by a few intervals).
        deadline = time.monotonic() + 10 * tc.Config().worker.heartbeat_interval + 10
        while True:
            instances = c.list_instances()
            loads = {i.instance_id: i.running for i in instances}
            if loads == {"inst-a": 3, "inst-b": 0} or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert loads == {"inst-a": 3, "inst-b": 0}

        infos = [SessionInfo(s.session_id, "inst-a", len(s.turns[0].prompt), busy=False,
                             request_id=s.turns[0].request_id) for s in sessions]
        rebalancer = Rebalancer(interval_s=1.0, gap=1, max_moves_per_tick=2, cooldown_s=60.0)
        moves = rebalancer.decide(100.0, instances, infos)
        assert [(m.source, m.target) for m in moves] == [("inst-a", "inst-b")]  # a second would invert the gap
        move = moves[0]
        again = rebalancer.decide(101.0, instances, infos)  # the next tick, on the same signals
        assert move.session_id not in {m.session_id for m in again}  # within its cooldown: it stays put

        outcome = MoveSession(c, router.table, timeout=60).run(move, instances)
        assert outcome.ok, outcome.steps
        moved = next(s for s in sessions if s.session_id == move.session_id)
        assert router.route(Request(moved.session_id, moved.turns[0].prompt), c.list_instances()) == "inst-b"

        # The session continues on inst-b from the hydrated KV cache; the original is still on inst-a.
        after = _engine(c, "inst-b", "generate", request_id=move.request_id, max_new_tokens=12)["tokens"]
        without = _engine(c, "inst-a", "generate", request_id=move.request_id, max_new_tokens=12)["tokens"]
        assert after == without
