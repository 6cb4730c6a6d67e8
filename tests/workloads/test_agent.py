"""Drawn agent sessions: the published shape's statistics, prefix growth, gap presets, reproducibility."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tensorcast.errors import InvalidArgument
from tensorcast.workloads import GAP_PRESETS, AgentWorkload, GapPreset


def test_turn_counts_have_the_agent_trace_mean_and_never_exceed_the_max() -> None:
    w = AgentWorkload(scale=0.01, seed=3)
    counts = np.array([len(s.turns) for s in w.sessions(3000)])
    assert abs(counts.mean() - 19.0) < 0.8
    assert counts.max() <= 50 and counts.min() >= 1
    assert counts.max() >= 40  # a long tail, not a constant
    short = AgentWorkload(scale=0.01, mean_turns=5.0, max_turns=8)
    assert max(len(s.turns) for s in short.sessions(500)) <= 8


@pytest.mark.parametrize("name", sorted(GAP_PRESETS))
def test_gap_medians_follow_the_preset(name: str) -> None:
    w = AgentWorkload(gaps=name, scale=0.01, seed=1)
    sessions = w.sessions(400)
    assert all(s.turns[0].gap_s == 0.0 for s in sessions)
    gaps = np.array([t.gap_s for s in sessions for t in s.turns[1:]])
    assert len(gaps) > 5000 and (gaps > 0).all()
    preset = GAP_PRESETS[name]
    assert abs(np.median(gaps) / math.exp(preset.mu) - 1) < 0.08
    assert abs(np.log(gaps).std() - preset.sigma) < 0.05


def test_presets_are_the_documented_ones() -> None:
    documented = {"fast": GapPreset(0.5, 1.0), "medium": GapPreset(1.65, 1.18), "slow": GapPreset(2.5, 1.2)}
    assert documented == GAP_PRESETS
    assert abs(GAP_PRESETS["medium"].median_s - 5.2) < 0.05


def test_context_grows_by_about_two_thousand_tokens_per_turn_and_keeps_its_prefix() -> None:
    w = AgentWorkload(seed=2)
    sessions = w.sessions(60)
    system = w.system_prompt()
    growth = []
    for s in sessions:
        first = s.turns[0]
        assert np.array_equal(first.prompt[:len(system)], system)  # every session shares the system prompt
        assert first.new_tokens == first.prompt_tokens
        for prev, cur in zip(s.turns, s.turns[1:], strict=False):
            assert np.array_equal(cur.prompt[:prev.prompt_tokens], prev.prompt)  # a prefix, kept whole
            assert cur.prompt_tokens == prev.prompt_tokens + prev.output_tokens + cur.new_tokens
            growth.append(cur.new_tokens)
    assert abs(np.mean(growth) / 2048 - 1) < 0.08
    inputs = sum(s.input_tokens for s in sessions)
    outputs = sum(s.output_tokens for s in sessions)
    assert 85 < inputs / outputs < 115  # input:output about 100:1


def test_scale_shrinks_tokens_but_not_the_session_shape() -> None:
    full, small = AgentWorkload(seed=4), AgentWorkload(seed=4, scale=0.05)
    a, b = full.session(7), small.session(7)
    assert len(a.turns) == len(b.turns)
    assert [t.gap_s for t in a.turns] == [t.gap_s for t in b.turns]
    assert len(small.system_prompt()) == round(2048 * 0.05)
    assert 0.03 < b.input_tokens / a.input_tokens < 0.07


def test_a_seed_reproduces_every_session_and_sessions_do_not_depend_on_each_other() -> None:
    a = AgentWorkload(seed=11, scale=0.1).sessions(5)
    b = AgentWorkload(seed=11, scale=0.1).sessions(3, start=2)
    for x, y in zip(a[2:], b, strict=True):
        assert x.session_id == y.session_id and len(x.turns) == len(y.turns)
        for tx, ty in zip(x.turns, y.turns, strict=True):
            assert (tx.gap_s, tx.new_tokens, tx.output_tokens, tx.request_id) == \
                   (ty.gap_s, ty.new_tokens, ty.output_tokens, ty.request_id)
            assert np.array_equal(tx.prompt, ty.prompt)
    other = AgentWorkload(seed=12, scale=0.1).session(2)
    assert not np.array_equal(other.turns[0].prompt, a[2].turns[0].prompt)
    assert a[0].session_id == "agent-00000" and a[0].turns[1].request_id == "agent-00000/1"


def test_prompts_are_read_only_and_within_the_vocabulary() -> None:
    s = AgentWorkload(seed=5, scale=0.1, vocab_size=256).session(0)
    prompt = s.turns[-1].prompt
    assert prompt.dtype == np.int32 and prompt.min() >= 0 and prompt.max() < 256
    with pytest.raises(ValueError):
        prompt[0] = 1


@pytest.mark.parametrize("kw", [{"gaps": "glacial"}, {"mean_turns": 60.0}, {"mean_turns": 1.0}, {"scale": 0.0},
                                {"io_ratio": -1.0}, {"vocab_size": 1}, {"tool_tokens": 0}])
def test_bad_settings_are_refused(kw: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument):
        AgentWorkload(**kw)  # type: ignore[arg-type]


def test_bad_indices_are_refused() -> None:
    with pytest.raises(InvalidArgument):
        AgentWorkload().session(-1)
    with pytest.raises(InvalidArgument):
        AgentWorkload().sessions(-1)


def test_a_custom_gap_preset_is_accepted() -> None:
    s = AgentWorkload(gaps=GapPreset(0.0, 0.0), scale=0.01).session(0)
    assert len(s.turns) > 1 and all(t.gap_s == 1.0 for t in s.turns[1:])
