"""The simulator shaped like the live benchmark's cluster (``SimConfig.prefix_sharing=False``,
``load_signal="sessions"``): each instance's cache serves only the session that filled it, while the session
stays, and the routers see resident sessions as an instance's load. Hand-checkable cases."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pytest

from tensorcast.errors import InvalidArgument
from tensorcast.policies import Move, Rebalancer, Request, Router, SessionInfo, StickySessions
from tensorcast.records import InstanceInfo
from tensorcast.sim import CostModel, Policy, Replay, SimConfig, simulate
from tensorcast.workloads import Session, Turn

COST = CostModel(prefill_base_s=0.1, prefill_per_token_s=0.01, kv_bytes_per_token=1000, transfer_bandwidth=1e6,
                 transfer_latency_s=0.01)
TWO = SimConfig(instances=2, max_batch=4, kv_capacity_tokens=4096, block_tokens=16, cost=COST)
PRIVATE = dataclasses.replace(TWO, prefix_sharing=False)
TOKENS = np.random.default_rng(0).integers(0, 1000, 400, dtype=np.int32)


def session(sid: str, turns: int = 2, gap: float = 2.0, first: float = 0.0) -> Session:
    """Turn k: the first 64 + 48·k tokens of ``TOKENS`` (every session the same prompts), 16 tokens out."""
    return Session(sid, tuple(Turn(sid, k, gap if k else 0.0, TOKENS[:64 + 48 * k], 64 if k == 0 else 32, 16,
                                   arrival_s=first if k == 0 else None) for k in range(turns)))


class Scripted(Router):
    """Routes the n-th request (over all sessions) to ``order[n]``, recording the signals it saw."""

    def __init__(self, order: Sequence[str]) -> None:
        self.order, self.seen = list(order), []  # type: ignore[var-annotated]

    def choose(self, request: Request, instances: Sequence[InstanceInfo]) -> str:
        self.seen.append({i.instance_id: (i.running, i.waiting) for i in instances})
        return self.order[len(self.seen) - 1]


def hits(config: SimConfig, sessions: Sequence[Session], order: Sequence[str]) -> list[int]:
    result = simulate(Policy("scripted", Scripted(order)), Replay(sessions), config)
    return [t.local_hit_tokens for t in sorted(result.turns, key=lambda t: t.issued_s)]


def test_another_session_finds_nothing_in_a_private_cache() -> None:
    two = [session("a"), session("b", turns=1, first=1.0)]  # b's only prompt is a's first one, on the same instance
    on_zero = ["instance-0"] * 3
    # a's second turn reuses its first turn's 80 tokens of context (5 whole blocks) either way; b hits a's
    # prompt (all but the last token, which an engine computes) only through a prefix cache.
    assert hits(TWO, two, on_zero) == [0, 63, 80]
    assert hits(PRIVATE, two, on_zero) == [0, 0, 80]


def test_a_session_hits_its_own_cache_while_it_stays_and_not_once_it_left() -> None:
    three = [session("a", turns=3)]
    assert hits(PRIVATE, three, ["instance-0"] * 3) == [0, 80, 128]
    # a -> instance-1 -> back to instance-0: its first stay's blocks there are gone (the engine dropped them)
    away_and_back = ["instance-0", "instance-1", "instance-0"]
    assert hits(PRIVATE, three, away_and_back) == [0, 0, 0]
    assert hits(TWO, three, away_and_back) == [0, 0, 80]  # a prefix cache keeps them


class MoveOnce(Rebalancer):
    """Moves the first idle session with KV to the other instance, once."""

    def __init__(self) -> None:
        super().__init__(interval_s=0.05)
        self.done = False

    def decide(self, now: float, instances: Sequence[InstanceInfo], sessions: Sequence[SessionInfo]) -> list[Move]:
        for s in sessions:
            if not s.busy and not self.done:
                self.done = True
                other = next(i.instance_id for i in instances if i.instance_id != s.instance_id)
                return [Move(s.session_id, s.instance_id, other, s.kv_tokens, s.session_id, now)]
        return []


def test_a_moved_session_hits_its_kv_on_the_target_without_prefix_sharing() -> None:
    policy = Policy("moved", StickySessions(Scripted(["instance-0"])), rebalancer=MoveOnce())
    result = simulate(policy, Replay([session("a")]), PRIVATE)
    (move,) = result.moves
    t0, t1 = sorted(result.turns, key=lambda t: t.turn)
    assert (move.source, move.target) == (t0.instance_id, t1.instance_id) == ("instance-0", "instance-1")
    assert t1.local_hit_tokens == 80  # hydrated under the session's new stay on the target


def test_the_sessions_signal_counts_resident_sessions_busy_or_idle() -> None:
    # a runs its first turn on instance-0 and idles; b arrives meanwhile and sees a as instance-0's load.
    two = [session("a", gap=5.0), session("b", turns=1, first=3.0)]
    order = ["instance-0", "instance-1", "instance-0"]
    engine = Scripted(order)
    simulate(Policy("e", engine), Replay(two), TWO)
    sessions = Scripted(order)
    simulate(Policy("s", sessions), Replay(two), dataclasses.replace(TWO, load_signal="sessions"))
    assert engine.seen[1] == {"instance-0": (0, 0), "instance-1": (0, 0)}  # nothing running at t=3
    assert sessions.seen[1] == {"instance-0": (1, 0), "instance-1": (0, 0)}
    assert sessions.seen[2] == {"instance-0": (1, 0), "instance-1": (0, 0)}  # b finished: only a is resident
    with pytest.raises(InvalidArgument, match="load_signal"):
        SimConfig(load_signal="requests")
