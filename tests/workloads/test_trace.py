"""Mooncake-format trace replay: parsing, grouping requests into sessions, deterministic block tokens, scale."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tensorcast.errors import InvalidArgument, NotFound
from tensorcast.workloads import block_token_ids, group_sessions, load_trace, parse_records, read_trace, replay


def write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def row(ts: float, n_in: int, n_out: int, ids: list[int]) -> dict[str, Any]:
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}


# Two conversations that share a 2-block system prompt (ids 0, 1), interleaved in time, plus a stranger.
# Conversation A: [0,1,2,3] (1900 tokens: 3 whole blocks) then [0,1,2,4,5] — block 3 was partial, so it
# changed id once filled — then [0,1,2,4,5,6,7]. Conversation B: [0,1,10,11] then [0,1,10,11,12].
ROWS = [
    row(1000, 1900, 40, [0, 1, 2, 3]),
    row(1500, 2000, 30, [0, 1, 10, 11]),
    row(2000, 50, 5, [99]),
    row(4000, 2400, 20, [0, 1, 2, 4, 5]),
    row(4500, 2100, 10, [0, 1, 10, 11, 12]),
    row(9000, 3300, 60, [0, 1, 2, 4, 5, 6, 7]),
]


def test_requests_are_grouped_by_shared_hash_id_prefixes(tmp_path: Path) -> None:
    records = read_trace(write(tmp_path / "t.jsonl", ROWS))
    assert group_sessions(records) == [[0, 3, 5], [1, 4], [2]]


def test_a_prefix_several_sessions_hold_continues_none_of_them() -> None:
    # A common system prompt (id 0): B's first request passes it, A's first request ends right after it.
    records = parse_records(json.dumps(r) for r in [row(0, 1100, 1, [0, 2, 3]), row(1, 700, 1, [0, 1]),
                                                     row(2, 1600, 1, [0, 4, 5, 6]),
                                                     row(3, 1600, 1, [0, 2, 7, 8])])
    assert group_sessions(records) == [[0, 3], [1], [2]]  # [0, 4, ...] could be anyone's: a new session
    # Two requests with equal whole blocks: which conversation a longer one continues is unknowable.
    twins = parse_records(json.dumps(r) for r in [row(0, 1024, 1, [5, 6]), row(1, 1024, 1, [5, 6]),
                                                   row(2, 2000, 1, [5, 6, 7, 8])])
    assert group_sessions(twins) == [[0], [1], [2]]


def test_a_request_must_add_a_block_and_share_a_whole_one_to_continue() -> None:
    same = parse_records(json.dumps(r) for r in [row(0, 1024, 1, [5, 6]), row(1, 1024, 1, [5, 6])])
    assert group_sessions(same) == [[0], [1]]  # a repeat is not a continuation
    lone = parse_records(json.dumps(r) for r in [row(0, 100, 1, [5]), row(1, 600, 1, [5, 6])])
    assert group_sessions(lone) == [[0], [1]]  # 100 tokens: no whole block to continue from
    chain = parse_records(json.dumps(r) for r in [row(0, 600, 1, [5, 6]), row(1, 1100, 1, [5, 7, 8]),
                                                   row(2, 1600, 1, [5, 7, 9, 10])])
    assert group_sessions(chain) == [[0, 1, 2]]


def test_replay_builds_turns_with_real_prefix_reuse_and_times(tmp_path: Path) -> None:
    sessions = load_trace(write(tmp_path / "t.jsonl", ROWS), vocab_size=1000)
    a, b, c = sessions
    assert [s.session_id for s in sessions] == ["trace-00000", "trace-00001", "trace-00002"]
    assert [t.prompt_tokens for t in a.turns] == [1900, 2400, 3300]
    assert [t.arrival_s for t in a.turns] == [0.0, 3.0, 8.0]
    assert [t.gap_s for t in a.turns] == [0.0, 3.0, 5.0]
    assert [t.output_tokens for t in a.turns] == [40, 20, 60]
    # Turn 1 shares blocks 0-2 (1536 tokens) with turn 0; the rest is new.
    assert [t.new_tokens for t in a.turns] == [1900, 2400 - 1536, 3300 - 5 * 512]
    assert np.array_equal(a.turns[1].prompt[:1536], a.turns[0].prompt[:1536])
    assert not np.array_equal(a.turns[1].prompt[1536:1900], a.turns[0].prompt[1536:1900])  # id 3 vs 4
    # The shared system prompt (ids 0, 1) is the same tokens in every session.
    assert np.array_equal(a.turns[0].prompt[:1024], b.turns[0].prompt[:1024])
    assert not np.array_equal(a.turns[0].prompt[1024:1536], b.turns[0].prompt[1024:1536])
    assert c.turns[0].prompt_tokens == 50 and c.turns[0].arrival_s == 1.0
    assert max(int(t.prompt.max()) for s in sessions for t in s.turns) < 1000


def test_block_tokens_are_a_fixed_function_of_the_hash_id() -> None:
    x = block_token_ids(12345, 512, 32000)
    assert x.dtype == np.int32 and x.shape == (512,)
    assert np.array_equal(x, block_token_ids(12345, 512, 32000))
    assert np.array_equal(block_token_ids(12345, 100, 32000), x[:100])
    assert (x != block_token_ids(12346, 512, 32000)).mean() > 0.99
    assert len(np.unique(x)) > 400  # not a constant or a short cycle
    assert block_token_ids(2**63 + 5, 4, 7).max() < 7


def test_scale_shrinks_lengths_and_keeps_one_block_per_hash_id(tmp_path: Path) -> None:
    sessions = load_trace(write(tmp_path / "t.jsonl", ROWS), scale=0.1)
    a = sessions[0]
    assert [t.prompt_tokens for t in a.turns] == [190, 240, 330]  # 51-token blocks; 1900 * 0.1 = 190
    assert [t.output_tokens for t in a.turns] == [4, 2, 6]
    assert np.array_equal(a.turns[2].prompt[:240], a.turns[1].prompt)  # 4 whole blocks and 36 of the 5th
    assert sessions[2].turns[0].prompt_tokens == 5 and sessions[2].turns[0].output_tokens == 1
    # A length that would leave the last hash id without a token keeps at least one token of it.
    (s,) = replay(parse_records([json.dumps(row(0, 1030, 1, [1, 2, 3]))]), scale=0.01)
    assert s.turns[0].prompt_tokens == 2 * 5 + 1


def test_limit_keeps_the_first_requests(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", ROWS)
    assert sum(len(s.turns) for s in load_trace(path, limit=4)) == 4
    assert len(read_trace(path, limit=0)) == 0


def test_equal_inputs_give_equal_replays(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", ROWS)
    one, two = load_trace(path, scale=0.5), load_trace(path, scale=0.5)
    for x, y in zip(one, two, strict=True):
        for tx, ty in zip(x.turns, y.turns, strict=True):
            assert np.array_equal(tx.prompt, ty.prompt) and tx.request_id == ty.request_id


def test_malformed_traces_are_refused_with_their_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROWS[0]) + "\n\n{not json\n")
    with pytest.raises(InvalidArgument, match=r"bad.jsonl:3"):
        read_trace(bad)
    broken_rows: list[Any] = [{"timestamp": 1, "input_length": 5, "output_length": 1},
                              row(1, -5, 1, [1]), {**row(1, 5, 1, []), "hash_ids": ["x"]}, row(1, 5, 1, [-1]),
                              {**row(1, 5, 1, []), "timestamp": "soon"}, [1, 2]]
    for broken in broken_rows:
        with pytest.raises(InvalidArgument):
            parse_records([json.dumps(broken)])
    with pytest.raises(NotFound):
        read_trace(tmp_path / "missing.jsonl")
    with pytest.raises(InvalidArgument):
        replay([], scale=0.0)
    with pytest.raises(InvalidArgument):
        parse_records([], limit=-1)
