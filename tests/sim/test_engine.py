"""The simulator: exact TTFTs in hand-computable cases, prefix caching and the shared store, moves, the policy
classes driven unchanged through simulated signals, determinism, and no ping-pong under a steady imbalance."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np
import pytest

from tensorcast.errors import InvalidArgument
from tensorcast.policies import (
    LoadAwareShared,
    Move,
    PowerOfTwo,
    Rebalancer,
    Request,
    Router,
    SessionInfo,
    SessionTable,
    StickySessions,
)
from tensorcast.records import InstanceInfo
from tensorcast.sim import (
    BlockCache,
    ClosedLoop,
    CostModel,
    EventLoop,
    Policy,
    Replay,
    SimConfig,
    SimResult,
    extend_keys,
    simulate,
)
from tensorcast.workloads import AgentWorkload, Session, Turn

COST = CostModel(prefill_base_s=0.1, prefill_per_token_s=0.01, prefill_per_token2_s=1e-5, prefill_per_cached_s=1e-4,
                 decode_base_s=0.02, decode_per_seq_s=0.005, decode_per_context_s=1e-4, kv_bytes_per_token=1000,
                 transfer_bandwidth=1e6, transfer_latency_s=0.01)
ONE = SimConfig(instances=1, max_batch=4, kv_capacity_tokens=4096, block_tokens=16, cost=COST)
TWO = SimConfig(instances=2, max_batch=4, kv_capacity_tokens=4096, block_tokens=16, cost=COST)


def two_turns(gap: float = 2.0, out0: int = 20) -> Session:
    """Turn 0: a 64-token prompt, ``out0`` tokens out. Turn 1: that prompt, the output and 28 new tokens."""
    tokens = np.random.default_rng(0).integers(0, 1000, 200, dtype=np.int32)
    first = Turn("s", 0, 0.0, tokens[:64], 64, out0)
    second = Turn("s", 1, gap, tokens[:64 + out0 + 28], 28, 1)
    return Session("s", (first, second))


def decode_s(cost: CostModel, prompt: int, steps: int) -> float:
    """``steps`` decode steps of one sequence after its prefill (its first token came from the prefill)."""
    return sum(cost.decode_step_s(1, prompt + k) for k in range(1, steps + 1))


class Alternate(Router):
    """Turn k of a session goes to instance k % 2: forces a turn away from its cache."""

    def choose(self, request: Request, instances: Sequence[InstanceInfo]) -> str:
        self.calls = getattr(self, "calls", 0) + 1
        return instances[(self.calls - 1) % len(instances)].instance_id


def test_ttft_is_the_analytic_value_on_one_instance() -> None:
    result = simulate(Policy("one", LoadAwareShared()), Replay([two_turns()]), ONE)
    t0, t1 = result.turns
    assert t0.issued_s == 0.0 and t0.ttft_s == pytest.approx(COST.prefill_s(64, 0))
    assert t0.done_s == pytest.approx(COST.prefill_s(64, 0) + decode_s(COST, 64, 19))
    # The next prompt reuses 64 + 20 = 84 tokens: 5 whole blocks (80 tokens) are cached; 32 are computed.
    assert t1.issued_s == pytest.approx(t0.done_s + 2.0)
    assert t1.local_hit_tokens == 80 and t1.store_hit_tokens == 0
    assert t1.ttft_s == pytest.approx(COST.prefill_s(112 - 80, 80))
    s = result.summary()
    assert s["hit_rate"] == pytest.approx(80 / (64 + 112))
    assert s["median_ttft_s"] == pytest.approx((t0.ttft_s + t1.ttft_s) / 2)


def test_a_turn_away_from_its_cache_loads_from_the_store_or_recomputes() -> None:
    shared = simulate(Policy("shared", Alternate(), shared_kv=True), Replay([two_turns()]), TWO)
    turn = shared.turns[1]
    assert turn.instance_id == "instance-1" and turn.local_hit_tokens == 0 and turn.store_hit_tokens == 80
    assert turn.ttft_s == pytest.approx(COST.prefill_s(32, 80) + COST.transfer_s(80))
    assert shared.fetched_bytes == 80 * 1000
    alone = simulate(Policy("alone", Alternate()), Replay([two_turns()]), TWO)
    assert alone.turns[1].local_hit_tokens == alone.turns[1].store_hit_tokens == 0
    assert alone.turns[1].ttft_s == pytest.approx(COST.prefill_s(112, 0))


def renamed(session: Session, sid: str, seed: int | None = None) -> Session:
    """``session`` under another id; with ``seed``, its tokens redrawn (no prefix shared with the original)."""
    tokens = np.random.default_rng(seed).integers(0, 1000, 200, dtype=np.int32) if seed is not None else None
    return Session(sid, tuple(Turn(sid, t.turn, t.gap_s, t.prompt if tokens is None else tokens[:t.prompt_tokens],
                                   t.new_tokens, t.output_tokens) for t in session.turns))


def test_a_queued_request_waits_and_reuses_the_blocks_computed_before_it() -> None:
    # Two sessions with the same first prompt arrive together: the second waits for the first one's prefill,
    # then finds its whole blocks cached and computes only the last token.
    result = simulate(Policy("one", LoadAwareShared()), Replay([two_turns(), renamed(two_turns(), "t")]), ONE)
    a, b = (t for t in result.turns if t.turn == 0)
    assert a.ttft_s == pytest.approx(COST.prefill_s(64, 0))
    assert b.local_hit_tokens == 63 and b.ttft_s == pytest.approx(COST.prefill_s(64, 0) + COST.prefill_s(1, 63))


def test_waiting_requests_share_one_prefill_iteration() -> None:
    # While the first session's prefill runs, two unrelated ones queue; both are admitted in the next
    # iteration, which pays the base cost once.
    sessions = [two_turns(), renamed(two_turns(), "t", seed=1), renamed(two_turns(), "u", seed=2)]
    result = simulate(Policy("one", LoadAwareShared()), Replay(sessions), ONE)
    first = {t.session_id: t for t in result.turns if t.turn == 0}
    together = COST.prefill_s(64, 0) + 2 * COST.prefill_s(64, 0) - COST.prefill_base_s
    assert first["t"].ttft_s == pytest.approx(together) and first["u"].ttft_s == pytest.approx(together)


def test_an_instance_is_slowed_down_while_others_are_busy() -> None:
    k = 0.5
    cost = dataclasses.replace(COST, prefill_contention=k, decode_contention=k)
    two = dataclasses.replace(TWO, cost=cost)
    sessions = [two_turns(), renamed(two_turns(), "t", seed=1)]
    result = simulate(Policy("alternate", Alternate()), Replay(sessions), two)
    first = {t.session_id: t for t in result.turns if t.turn == 0}
    # Both arrive at 0: the first instance starts alone; the second starts while the first is busy.
    assert sorted(t.ttft_s for t in first.values()) == pytest.approx([cost.prefill_s(64, 0),
                                                                      cost.prefill_s(64, 0) * (1 + k)])
    alone = simulate(Policy("alternate", Alternate()), Replay(sessions[:1]), two)
    assert alone.turns[0].ttft_s == pytest.approx(cost.prefill_s(64, 0))


def test_every_prefill_call_pays_its_overhead_and_a_shared_store_its_page_store() -> None:
    o, s0, s1 = 0.01, 0.02, 1e-4
    cost = dataclasses.replace(COST, request_overhead_s=o, store_base_s=s0, store_per_token_s=s1)
    one = dataclasses.replace(ONE, cost=cost)
    local = simulate(Policy("local", StickySessions(LoadAwareShared())), Replay([two_turns()]), one).turns[0]
    shared = simulate(Policy("shared", StickySessions(LoadAwareShared()), shared_kv=True), Replay([two_turns()]),
                      one).turns[0]
    assert local.ttft_s == pytest.approx(COST.prefill_s(64, 0) + o)
    assert shared.ttft_s == pytest.approx(COST.prefill_s(64, 0) + o + s0 + s1 * 64)


def test_a_request_pays_its_decoding_setup_once() -> None:
    r = 0.05
    with_setup = dataclasses.replace(ONE, cost=dataclasses.replace(COST, decode_per_request_s=r))
    base = simulate(Policy("one", LoadAwareShared()), Replay([two_turns()]), ONE).turns[0]
    setup = simulate(Policy("one", LoadAwareShared()), Replay([two_turns()]), with_setup).turns[0]
    assert setup.ttft_s == pytest.approx(base.ttft_s)  # the first token comes from the prefill
    assert setup.done_s == pytest.approx(base.done_s + r)


class Scripted(Rebalancer):
    """Moves ``session`` to the other instance once, at the first tick where it is idle with KV."""

    def __init__(self, session: str) -> None:
        super().__init__(interval_s=0.05)
        self.session, self.done = session, False

    def decide(self, now: float, instances: Sequence[InstanceInfo], sessions: Sequence[SessionInfo]) -> list[Move]:
        for s in sessions:
            if s.session_id == self.session and not s.busy and not self.done:
                self.done = True
                other = next(i.instance_id for i in instances if i.instance_id != s.instance_id)
                return [Move(s.session_id, s.instance_id, other, s.kv_tokens, s.session_id, now)]
        return []


def test_a_move_makes_the_next_turn_hit_on_the_target_and_waits_for_it() -> None:
    policy = Policy("moved", StickySessions(LoadAwareShared()), rebalancer=Scripted("s"))
    result = simulate(policy, Replay([two_turns(gap=0.01)]), TWO)
    (move,) = result.moves
    t0, t1 = result.turns
    assert (move.source, move.target) == (t0.instance_id, t1.instance_id) == ("instance-0", "instance-1")
    assert move.kv_tokens == 84 and move.kv_bytes == 84_000
    assert move.done_s - move.start_s == pytest.approx(COST.move_s(84))
    # The turn was issued mid-move: it waited for the KV, then hit it on the target.
    assert t1.issued_s < move.done_s
    assert t1.local_hit_tokens == 80 and t1.store_hit_tokens == 0
    assert t1.first_token_s == pytest.approx(move.done_s + COST.prefill_s(32, 80))
    assert result.summary()["sessions_moved"] == 1


class Spy(Rebalancer):
    """The stock rebalancer, recording what the simulator called it with and what it answered."""

    def __init__(self, **kwargs: float) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.calls: list[tuple[float, list[InstanceInfo], list[SessionInfo], list[Move]]] = []

    def decide(self, now: float, instances: Sequence[InstanceInfo], sessions: Sequence[SessionInfo]) -> list[Move]:
        moves = super().decide(now, instances, sessions)
        self.calls.append((now, list(instances), list(sessions), moves))
        return moves


def agent_sessions(n: int, seed: int = 0) -> list[Session]:
    return AgentWorkload(gaps="fast", scale=1 / 32, mean_turns=6, max_turns=12, seed=seed).sessions(n)


def pinned_to_first(sessions: Sequence[Session]) -> StickySessions:
    table = SessionTable()
    for s in sessions:
        table.assign(s.session_id, "instance-0")
    return StickySessions(LoadAwareShared(), table)


def test_the_policy_classes_run_unchanged_on_simulated_signals() -> None:
    sessions = agent_sessions(12)
    spy = Spy(interval_s=0.5, gap=2, max_moves_per_tick=2, cooldown_s=5.0)
    config = SimConfig(instances=3, max_batch=4, kv_capacity_tokens=8192)
    result = simulate(Policy("tc", pinned_to_first(sessions), shared_kv=True, rebalancer=spy),
                      Replay(sessions), config)
    assert spy.calls and result.moves
    for _, instances, infos, _ in spy.calls:
        assert all(type(i) is InstanceInfo for i in instances) and all(type(s) is SessionInfo for s in infos)
        assert [i.instance_id for i in instances] == ["instance-0", "instance-1", "instance-2"]
        assert all(i.alive and i.kv_tokens_capacity == 8192 and i.kv_tokens_used <= 8192 for i in instances)
    # Its decisions are a pure function of what it was given: a fresh rebalancer fed the same records agrees.
    fresh = Rebalancer(interval_s=0.5, gap=2, max_moves_per_tick=2, cooldown_s=5.0)
    assert [fresh.decide(now, inst, infos) for now, inst, infos, _ in spy.calls] == [m for *_, m in spy.calls]
    assert len(result.moves) == sum(len(m) for *_, m in spy.calls)


def test_a_steady_imbalance_makes_no_session_ping_pong() -> None:
    sessions = agent_sessions(24, seed=3)
    cooldown = 5.0
    spy = Spy(interval_s=0.2, gap=1, max_moves_per_tick=3, cooldown_s=cooldown)
    result = simulate(Policy("tc", pinned_to_first(sessions), shared_kv=True, rebalancer=spy),
                      Replay(sessions), SimConfig(instances=4, max_batch=4, kv_capacity_tokens=16384))
    assert len(result.moves) >= 5
    by_session: dict[str, list[tuple[float, str, str]]] = {}
    for m in result.moves:
        by_session.setdefault(m.session_id, []).append((m.start_s, m.source, m.target))
    for moves in by_session.values():
        for (t1, a, b), (t2, c, d) in itertools.pairwise(moves):
            assert c == b  # a session moves from where it is
            assert t2 - t1 >= cooldown, f"moved {a}->{b} at {t1}, then {c}->{d} at {t2}"  # d == a: back
    assert any(len(m) > 1 for m in by_session.values())  # sessions did move again, after their cooldown


def closed_loop_run(seed: int, policy: Policy) -> SimResult:
    wl = AgentWorkload(gaps="fast", scale=1 / 32, mean_turns=5, max_turns=10, seed=1)
    return simulate(policy, ClosedLoop(wl, concurrency=12, horizon_s=40.0, ramp_s=5.0),
                    SimConfig(instances=4, max_batch=4, kv_capacity_tokens=8192), seed=seed)


def p2c_policy() -> Policy:
    return Policy("p2c", PowerOfTwo(seed=4))


def tc_policy() -> Policy:
    return Policy("tc", StickySessions(LoadAwareShared()), shared_kv=True,
                  rebalancer=Rebalancer(interval_s=0.5, gap=1, cooldown_s=5.0))


def test_runs_are_deterministic_for_a_seed() -> None:
    for make in (p2c_policy, tc_policy):
        a, b = closed_loop_run(7, make()), closed_loop_run(7, make())
        assert a.turns == b.turns and a.moves == b.moves and a.summary() == b.summary()
    assert closed_loop_run(8, tc_policy()).turns != closed_loop_run(7, tc_policy()).turns


def test_the_closed_loop_keeps_its_sessions_and_stops_issuing_at_the_horizon() -> None:
    result = closed_loop_run(1, Policy("las", LoadAwareShared(), shared_kv=True))
    assert result.sessions > 12  # finished sessions were replaced
    assert max(t.issued_s for t in result.turns) < 40.0
    assert all(t.first_token_s >= t.issued_s and t.done_s >= t.first_token_s for t in result.turns)
    assert {t.instance_id for t in result.turns} == {f"instance-{k}" for k in range(4)}


def test_block_cache_evicts_leaves_first_and_never_held_blocks() -> None:
    cache = BlockCache(4)
    cache.acquire([1, 2, 3], 1)
    assert cache.used_blocks == 4 and not cache.fits([9], 0)
    cache.release([1, 2, 3], 1, extra=[4])
    assert cache.used_blocks == 0 and list(cache.free) == [4, 3, 2, 1]  # prefix most recent
    cache.acquire([1, 7], 1)  # 3 blocks held: room for one cached block, the most recent one
    assert cache.match([1, 2, 3]) == 2 and 7 in cache.held and list(cache.free) == [2]


def test_keys_of_an_extended_prompt_equal_fresh_ones() -> None:
    tokens = np.random.default_rng(1).integers(0, 500, 300, dtype=np.int32)
    first = extend_keys(tokens[:100], 16)
    assert extend_keys(tokens[:250], 16, tokens[:100], first) == extend_keys(tokens[:250], 16)
    other = tokens.copy()
    other[40] += 1  # differs in block 2
    assert extend_keys(other[:250], 16, tokens[:100], first)[:2] == first[:2]
    assert extend_keys(other[:250], 16, tokens[:100], first) == extend_keys(other[:250], 16)


def test_bad_setups_are_refused() -> None:
    with pytest.raises(InvalidArgument):
        Policy("x", LoadAwareShared(), rebalancer=Rebalancer())
    with pytest.raises(InvalidArgument):
        SimConfig(kv_capacity_tokens=8, block_tokens=16)
    with pytest.raises(InvalidArgument):
        ClosedLoop(AgentWorkload(), concurrency=0, horizon_s=10.0)
    with pytest.raises(InvalidArgument):
        simulate(Policy("one", LoadAwareShared()), Replay([two_turns(out0=5000)]), ONE)  # more KV than it holds
    loop = EventLoop()
    loop.at(1.0, lambda: None)
    loop.run()
    with pytest.raises(InvalidArgument):
        loop.at(0.5, lambda: None)
