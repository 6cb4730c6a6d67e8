"""The vLLM KV connector's scheduler-side decisions on plain lists (no vLLM, no cluster)."""

from __future__ import annotations

import pytest

from tensorcast.errors import InvalidArgument
from tensorcast.integrations.vllm_block_keys import BlockHashChain, block_key, page_namespace
from tensorcast.integrations.vllm_kv_state import HANDOFF_PARAM, ConnectorState
from tensorcast.kv.keys import KVLayout, page_keys

LAYOUT = KVLayout("m|vllm|tp1", layers=2, kv_heads=2, head_dim=64, dtype="float32", page_size=4)


def state(**kw: object) -> ConnectorState:
    args: dict[str, object] = {"load": True, "save": True, "handoff_timeout": 5.0, **kw}
    return ConnectorState(LAYOUT, **args)  # type: ignore[arg-type]


def test_lookup_probes_whole_pages_before_the_last_token_beyond_local_ones() -> None:
    s = state()
    prompt = list(range(17))  # 4 full pages; the 17th token is computed, so all 4 pages are loadable
    keys = s.probe("r", prompt, 0, None)
    assert keys == page_keys(prompt, LAYOUT)[:4]
    assert s.probe("r16", list(range(16)), 0, None) == page_keys(range(16), LAYOUT)[:3]  # never the last token
    assert s.probe("local", prompt, 8, None) == keys[2:]  # vLLM computed two pages itself
    assert s.matched("local", 1, now=0.0) == 4  # one more page: 4 tokens
    s.allocated("local", list(range(100, 110)), 4)
    plan = s.step([("local", prompt, list(range(100, 110)), 4)])
    assert [(t.keys, t.block_ids) for t in plan.loads] == [(keys[2:3], [102])]


def test_saves_every_page_once_prompt_and_generated_and_not_what_was_loaded() -> None:
    s = state()
    tokens = list(range(10))
    s.probe("r", tokens, 0, None)
    assert s.matched("r", 1, 0.0) == 4
    s.allocated("r", [7, 8, 9], 4)
    step1 = s.step([("r", tokens, [7, 8, 9], 10)])  # prefill of the rest
    assert [t.block_ids for t in step1.loads] == [[7]]
    assert [(t.keys, t.block_ids) for t in step1.saves] == [(page_keys(tokens, LAYOUT)[1:2], [8])]
    tokens += [50, 51]  # two generated tokens fill page 2
    assert s.step([("r", tokens[:11], [7, 8, 9], 11)]).saves == []  # page 2 not full yet
    step3 = s.step([("r", tokens, [7, 8, 9], 12)])
    assert [(t.keys, t.block_ids) for t in step3.saves] == [(page_keys(tokens, LAYOUT)[2:3], [9])]
    assert s.finished("r") == {HANDOFF_PARAM: 3}
    assert "r" not in s.requests


def test_roles_and_per_request_opt_out() -> None:
    consumer = state(save=False)
    consumer.probe("r", list(range(9)), 0, None)
    assert consumer.step([("r", list(range(9)), [1, 2, 3], 9)]).saves == []
    assert consumer.finished("r") is None  # nothing handed over
    producer = state(load=False)
    assert producer.probe("r", list(range(9)), 0, None) == []
    both = state()
    assert both.probe("r", list(range(9)), 0, {"tensorcast": {"load": False, "save": False}}) == []
    assert both.step([("r", list(range(9)), [1, 2, 3], 9)]).saves == []
    with pytest.raises(InvalidArgument):
        both.probe("bad", [1, 2, 3], 0, {HANDOFF_PARAM: -1})
    with pytest.raises(InvalidArgument):
        both.probe("bad2", [1, 2, 3], 0, {"tensorcast": "yes"})


def test_consumer_waits_for_handed_over_pages_up_to_the_timeout() -> None:
    s = state(save=False, handoff_timeout=2.0)
    prompt = list(range(13))  # 3 loadable pages
    s.probe("r", prompt, 0, {HANDOFF_PARAM: 3})
    assert s.matched("r", 1, now=10.0) is None  # producer's pages still arriving: ask again
    assert s.matched("r", 3, now=10.5) == 12
    s.probe("late", prompt, 0, {HANDOFF_PARAM: 3})
    assert s.matched("late", 2, now=20.0) is None
    assert s.matched("late", 2, now=22.0) == 8  # timed out: take what is there, compute the rest


def test_allocation_that_is_not_whole_pages_is_refused() -> None:
    s = state()
    s.probe("r", list(range(9)), 0, None)
    s.matched("r", 2, 0.0)
    with pytest.raises(InvalidArgument):
        s.allocated("r", [1, 2, 3], 6)
    with pytest.raises(InvalidArgument):
        s.allocated("r", [1], 8)  # fewer blocks than pages


def test_pages_named_by_the_engines_block_hashes() -> None:
    hashes: dict[str, list[bytes]] = {"r": [bytes([i]) * 32 for i in range(2)]}  # vLLM hashed 2 blocks so far
    ns = page_namespace("m", LAYOUT.dtype, LAYOUT.page_size, LAYOUT.layers, LAYOUT.page_bytes).id
    s = state(chain=lambda req_id: BlockHashChain(ns, lambda: hashes[req_id], LAYOUT.page_size))
    tokens = list(range(13))
    assert s.probe("r", tokens, 0, None) == [block_key(ns, h) for h in hashes["r"]]
    s.matched("r", 0, 0.0)
    # Three full pages computed, two hashed: the third is saved once the engine has hashed it.
    step = s.step([("r", tokens, [5, 6, 7, 8], 13)])
    assert [(t.keys, t.block_ids) for t in step.saves] == [([block_key(ns, h) for h in hashes["r"]], [5, 6])]
    hashes["r"].append(b"\x09" * 32)
    step = s.step([("r", tokens, [5, 6, 7, 8], 13)])
    assert [(t.keys, t.block_ids) for t in step.saves] == [([block_key(ns, b"\x09" * 32)], [7])]
    # The same engine config names the same pages on every instance; another layout never does.
    assert ns == page_namespace("m", "float32", 4, 2, LAYOUT.page_bytes).id
    assert ns != page_namespace("m", "float32", 4, 2, LAYOUT.page_bytes * 2).id
