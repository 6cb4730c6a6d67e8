"""The HF adaptor's local prefix cache (``prefill(..., continue_from=...)``): a request that takes over an
earlier request's cache computes exactly what a full recompute computes, forwards only the tokens past the
common prefix, reports where its tokens came from, and falls back to the normal path when there is nothing
to continue from."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from tensorcast.errors import InvalidArgument
from tensorcast.instance.hf import HFCausalLMAdaptor, PrefillReport, tiny_llama
from tensorcast.kv.keys import KVLayout


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


class DictPages:
    """A page store in a dict with the three calls prefix reuse makes (``exists``/``get``/``put``)."""

    def __init__(self) -> None:
        self.pages: dict[str, Any] = {}

    def exists(self, keys: Sequence[str]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.pages:
            n += 1
        return n

    def get(self, keys: Sequence[str]) -> list[Any]:
        return [self.pages.get(k) for k in keys]

    def put(self, keys: Sequence[str], pages: Sequence[Any], *, ttl: float | None = None,
            layout: KVLayout | None = None) -> int:
        new = [k for k in keys if k not in self.pages]
        for k, p in zip(keys, pages, strict=True):
            self.pages.setdefault(k, p.clone())
        return len(new)


@pytest.fixture(scope="module")
def model() -> Any:
    torch.set_num_threads(1)
    return tiny_llama(0, layers=2)


def report(a: HFCausalLMAdaptor, rid: str) -> PrefillReport:
    r = a.kv_report(rid)
    assert isinstance(r, PrefillReport)
    assert r.local_tokens + r.reused_tokens + r.prefilled_tokens == r.prompt_tokens
    return r


def test_continuing_a_turn_equals_a_full_recompute(model: Any) -> None:
    a = HFCausalLMAdaptor(model)
    first = tokens(1, 70)
    a.prefill("s/0", first)
    generated = a.generate("s/0", 5)
    # The next turn repeats the first turn's prompt and what the model generated, then adds a tool output.
    second = first + generated + tokens(2, 41)
    continued = a.prefill("s/1", second, continue_from="s/0")
    r = report(a, "s/1")
    assert (r.local_tokens, r.reused_tokens, r.prefilled_tokens) == (75, 0, 41)
    assert r.continued_from == "s/0" and "s/0" not in a.requests  # taken over, not copied

    fresh = HFCausalLMAdaptor(model)
    recomputed = fresh.prefill("x", second)
    assert report(fresh, "x").prefilled_tokens == len(second)
    np.testing.assert_allclose(continued, recomputed, atol=1e-4, rtol=1e-4)
    assert a.generate("s/1", 12) == fresh.generate("x", 12)


def test_a_partly_shared_history_keeps_only_the_common_prefix(model: Any) -> None:
    # A replayed workload's next prompt holds drawn output tokens, not the ones the model generated: the
    # cache is cropped to the prompt both share and the rest is forwarded.
    a = HFCausalLMAdaptor(model)
    first = tokens(3, 50)
    a.prefill("s/0", first)
    a.generate("s/0", 4)
    second = first + tokens(4, 30)
    continued = a.prefill("s/1", second, continue_from="s/0")
    r = report(a, "s/1")
    common = 50 + next((i for i, (x, y) in enumerate(zip(a.requests["s/1"].input_ids[0, 50:].tolist(),
                                                             second[50:], strict=False)) if x != y), 0)
    assert r.local_tokens == common >= 50 and r.prefilled_tokens == len(second) - common
    fresh = HFCausalLMAdaptor(model)
    np.testing.assert_allclose(continued, fresh.prefill("x", second), atol=1e-4, rtol=1e-4)
    assert a.generate("s/1", 8) == fresh.generate("x", 8)


def test_the_whole_prompt_cached_still_forwards_its_last_token(model: Any) -> None:
    a = HFCausalLMAdaptor(model)
    prompt = tokens(5, 40)
    a.prefill("s/0", prompt)
    again = a.prefill("s/1", prompt, continue_from="s/0")
    r = report(a, "s/1")
    assert (r.local_tokens, r.prefilled_tokens) == (39, 1)
    np.testing.assert_allclose(again, HFCausalLMAdaptor(model).prefill("x", prompt), atol=1e-4, rtol=1e-4)


def test_nothing_to_continue_falls_back_to_the_normal_path(model: Any) -> None:
    store = DictPages()
    a = HFCausalLMAdaptor(model, kv=store)
    b = HFCausalLMAdaptor(model, kv=store)
    prompt = tokens(6, 64)
    a.prefill("s/0", prompt, kv_reuse=True)  # stores the prompt's 4 full pages
    # Not on this instance: b takes the prefix from the shared store instead.
    longer = prompt + tokens(7, 20)
    b.prefill("s/1", longer, kv_reuse=True, continue_from="s/0")
    r = report(b, "s/1")
    assert (r.local_tokens, r.reused_tokens, r.prefilled_tokens, r.continued_from) == (0, 64, 20, "")
    # Nothing in common: the earlier request stays, the new one is recomputed in full.
    other = tokens(8, 30)
    other[0] = (prompt[0] + 1) % 256
    a.prefill("t/0", other, continue_from="s/0")
    assert report(a, "t/0").prefilled_tokens == 30 and "s/0" in a.requests
    # Continuing with shared KV on stores the new full pages for other instances: 124 tokens are 7 pages,
    # the 4 of the taken-over prefix are not cut again, page 4 is already there (b stored it), 5 and 6 are new.
    pages_before = len(store.pages)
    a.prefill("s/2", longer + tokens(9, 40), kv_reuse=True, continue_from="s/0")
    r = report(a, "s/2")
    assert r.local_tokens == 64 and r.stored_pages == len(store.pages) - pages_before == 2


def test_continue_through_the_engine_command_reports_the_sources(model: Any) -> None:
    a = HFCausalLMAdaptor(model)
    prompt = tokens(10, 30)
    a.engine_command("prefill", {"request_id": "s/0", "input_ids": prompt})
    reply = a.engine_command("prefill", {"request_id": "s/1", "input_ids": prompt + tokens(11, 10),
                                         "continue_from": "s/0"})
    kv = reply["kv"]
    assert (kv["local_tokens"], kv["reused_tokens"], kv["prefilled_tokens"]) == (30, 0, 10)
    with pytest.raises(InvalidArgument):
        a.prefill("s/2", prompt, kv_reuse=True, continue_from="s/1")  # no page store to reuse from
