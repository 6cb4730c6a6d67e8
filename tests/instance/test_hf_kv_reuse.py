"""Paged prefix reuse in the HF adaptor: the pure decisions, the prefill around them (an in-memory page store
that can lose or corrupt pages), and real instance processes sharing pages through a cluster's KV store."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch

import tensorcast as tc
from tensorcast.cluster import LocalCluster
from tensorcast.errors import InvalidArgument, Unavailable
from tensorcast.instance.hf import HFCausalLMAdaptor, tiny_llama
from tensorcast.instance.hf_pages import (
    layers_from_pages,
    layout_of,
    leading_pages,
    pages_from_layers,
    plan_prefill,
)
from tensorcast.kv.keys import KVLayout, page_keys
from tensorcast.testing import running_cluster

PS = 16  # the adaptor's default page size


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


# ----------------------------------------------------------------- pure decisions
def test_plan_reuses_leading_pages_and_always_prefills_the_last_token() -> None:
    p = plan_prefill(100, 16, 0)  # nothing stored: prefill all, store the 6 full pages
    assert (p.reuse_tokens, p.read_pages, p.prefill_tokens, p.store_first, p.store_end) == (0, 0, 100, 0, 6)
    p = plan_prefill(100, 16, 4)  # 4 pages stored: reuse them, store pages 4 and 5
    assert (p.reuse_tokens, p.read_pages, p.prefill_tokens, p.store_first, p.store_end) == (64, 4, 36, 4, 6)
    p = plan_prefill(96, 16, 6)  # the whole prompt is pages: read all, crop the last token, store nothing
    assert (p.reuse_tokens, p.read_pages, p.prefill_tokens, p.store_first, p.store_end) == (95, 6, 1, 6, 6)
    p = plan_prefill(100, 16, 9)  # more stored than the prompt has full pages (a longer prompt's chain)
    assert (p.reuse_tokens, p.read_pages, p.store_first) == (96, 6, 6)
    p = plan_prefill(10, 16, 0)  # shorter than a page: nothing to reuse or store
    assert (p.reuse_tokens, p.read_pages, p.store_first, p.store_end) == (0, 0, 0, 0)
    for n in range(1, 40):
        for stored in range(0, 5):
            p = plan_prefill(n, 4, stored)
            assert 1 <= p.prefill_tokens <= n and p.reuse_tokens <= stored * 4
            assert p.read_pages * 4 >= p.reuse_tokens > (p.read_pages - 1) * 4 or p.read_pages == 0
            assert p.store_end == n // 4 and p.store_first == min(stored, n // 4)
    with pytest.raises(InvalidArgument):
        plan_prefill(10, 0, 0)
    with pytest.raises(InvalidArgument):
        plan_prefill(0, 16, 0)


def test_leading_pages_stop_at_a_miss_and_refuse_a_wrong_size() -> None:
    layout = KVLayout("m", layers=2, kv_heads=2, head_dim=4, dtype="float32", page_size=2)
    good = np.zeros(layout.page_bytes, np.uint8)
    keys = ["a", "b", "c", "d"]
    assert len(leading_pages([good, good, None, good], layout, keys)) == 2
    assert leading_pages([None, good, good, good], layout, keys) == []
    with pytest.raises(InvalidArgument, match="b"):
        leading_pages([good, good[:-4], good, good], layout, keys)
    # A wrong page after the first miss is never used, so it is not an error here.
    assert len(leading_pages([good, None, good[:8], good], layout, keys)) == 1


def test_pages_round_trip_a_cache_and_crop() -> None:
    layout = KVLayout("m", layers=3, kv_heads=2, head_dim=4, dtype="float32", page_size=5)
    g = torch.Generator().manual_seed(0)
    layers = [(torch.randn(1, 2, 17, 4, generator=g), torch.randn(1, 2, 17, 4, generator=g)) for _ in range(3)]
    pages = pages_from_layers(layers, 1, 3, layout, 17)
    assert tuple(pages.shape) == (2, *layout.page_shape) and pages.is_contiguous()
    assert torch.equal(pages[0, 2, 1, :, 0], layers[2][1][0, :, 5])  # page 1, layer 2, V, token 5
    all_pages = pages_from_layers(layers, 0, 3, layout, 17)
    as_bytes = [p.reshape(-1).view(torch.uint8).numpy().copy() for p in all_pages]  # what a store returns
    back = layers_from_pages(as_bytes, 13, layout)
    for (k, v), (k2, v2) in zip(layers, back, strict=True):
        assert k2.shape == (1, 2, 13, 4) and k2.is_contiguous()
        assert torch.equal(k[:, :, :13], k2) and torch.equal(v[:, :, :13], v2)
    with pytest.raises(InvalidArgument):
        pages_from_layers(layers, 2, 4, layout, 17)  # page 3 is not full
    with pytest.raises(InvalidArgument):
        pages_from_layers(layers[:2], 0, 1, layout, 17)  # a layer missing


def test_layout_of_refuses_sliding_window_layers() -> None:
    model = tiny_llama(0)
    layout = layout_of(model.config, "float32", "m", 16)
    assert layout.page_shape == (2, 2, 2, 16, 16)
    model.config.layer_types = ["full_attention", "sliding_attention"]
    with pytest.raises(InvalidArgument, match="full-attention"):
        layout_of(model.config, "float32", "m", 16)


# ----------------------------------------------------------------- prefill against an in-memory store
class MemoryPages:
    """A page store in a dict, with ``exists``/``get``/``put`` like ``client.kv``; it can lose pages on read."""

    def __init__(self) -> None:
        self.pages: dict[str, np.ndarray] = {}
        self.lose_on_get: set[str] = set()  # evicted between exists and get
        self.fail_exists: Exception | None = None

    def exists(self, keys: Sequence[str]) -> int:
        if self.fail_exists is not None:
            raise self.fail_exists
        n = 0
        while n < len(keys) and keys[n] in self.pages:
            n += 1
        return n

    def get(self, keys: Sequence[str]) -> list[Any]:
        for k in self.lose_on_get:
            self.pages.pop(k, None)
        return [self.pages.get(k) for k in keys]

    def put(self, keys: Sequence[str], pages: Sequence[Any], *, ttl: float | None = None,
            layout: KVLayout | None = None) -> int:
        new = [k for k in keys if k not in self.pages]
        for k, p in zip(keys, pages, strict=True):
            if layout is not None:
                layout.check_page(p.numel() * p.element_size(), tuple(p.shape))
            self.pages.setdefault(k, p.reshape(-1).view(torch.uint8).numpy().copy())
        return len(new)


def _same_as_recompute(adaptor: HFCausalLMAdaptor, rid: str, prompt: list[int], logits: list[float]) -> None:
    ref = adaptor.prefill(f"{rid}-ref", prompt, kv_reuse=False)
    np.testing.assert_allclose(logits, ref, atol=1e-5, rtol=1e-5)
    assert adaptor.generate(rid, 8) == adaptor.generate(f"{rid}-ref", 8)


def test_prefix_reuse_in_process_matches_recompute() -> None:
    store = MemoryPages()
    a = HFCausalLMAdaptor(tiny_llama(0), kv=store, kv_reuse=True, kv_model_id="tiny-0")
    b = HFCausalLMAdaptor(tiny_llama(0), kv=store, kv_reuse=True, kv_model_id="tiny-0")
    long, short = tokens(1, 100), tokens(1, 96)  # the second prompt is exactly 6 stored pages
    a.prefill("a", long)
    assert a.kv_report("a").stored_pages == 6 and len(store.pages) == 6  # type: ignore[union-attr]
    before = b.forwarded_tokens
    logits = b.prefill("b", short)
    r = b.kv_report("b")
    assert r is not None and (r.matched_pages, r.read_pages, r.reused_tokens) == (6, 6, 95)
    assert r.prefilled_tokens == b.forwarded_tokens - before == 1
    _same_as_recompute(b, "b", short, logits)
    assert b.kv_stats.tokens_reused == 95 and b.kv_stats.by_outcome == {"hit": 1, "off": 1}


def test_a_page_evicted_after_exists_stops_reuse_at_the_gap_and_is_stored_again() -> None:
    store = MemoryPages()
    a = HFCausalLMAdaptor(tiny_llama(0), kv=store, kv_reuse=True, kv_model_id="tiny-0")
    prompt = tokens(2, 90)  # 5 full pages
    a.prefill("a", prompt)
    keys = page_keys(prompt, a.kv_layout())
    store.lose_on_get = {keys[2]}
    logits = a.prefill("b", prompt)
    r = a.kv_report("b")
    assert r is not None and (r.matched_pages, r.read_pages, r.reused_tokens, r.prefilled_tokens) == (5, 2, 32, 58)
    assert r.stored_pages == 1 and keys[2] in store.pages  # the gap is filled again; pages 3, 4 were there
    store.lose_on_get = set()
    _same_as_recompute(a, "b", prompt, logits)


def test_an_unreachable_store_degrades_to_recompute_and_other_weights_never_share_pages() -> None:
    store = MemoryPages()
    a = HFCausalLMAdaptor(tiny_llama(0), kv=store, kv_reuse=True)  # model id: a fingerprint of the weights
    other = HFCausalLMAdaptor(tiny_llama(1), kv=store, kv_reuse=True)
    prompt = tokens(3, 70)
    a.prefill("a", prompt)
    assert a.kv_layout().model_id != other.kv_layout().model_id
    other.prefill("o", prompt)
    assert other.kv_report("o").reused_tokens == 0  # type: ignore[union-attr]
    # transform_into to the same weights: the fingerprint follows, and the pages are shared.
    other.transform_into(tiny_llama(0).state_dict(), {})
    assert other.kv_layout().model_id == a.kv_layout().model_id
    logits = other.prefill("o2", prompt)
    assert other.kv_report("o2").reused_tokens == 64  # type: ignore[union-attr]
    _same_as_recompute(other, "o2", prompt, logits)

    store.fail_exists = Unavailable("home restarting")
    logits = a.prefill("down", prompt)
    r = a.kv_report("down")
    assert r is not None and r.reused_tokens == 0 and r.prefilled_tokens == 70 and "lookup" in r.degraded
    _same_as_recompute(a, "down", prompt, logits)


def test_pages_of_other_weights_under_one_model_id_change_the_output() -> None:
    """The control for every equality above: wrong K/V in the cache do show in the logits."""
    store = MemoryPages()
    HFCausalLMAdaptor(tiny_llama(1), kv=store, kv_reuse=True, kv_model_id="mislabelled").prefill("x", tokens(4, 50))
    b = HFCausalLMAdaptor(tiny_llama(0), kv=store, kv_reuse=True, kv_model_id="mislabelled")
    logits = b.prefill("b", tokens(4, 50))
    assert b.kv_report("b").reused_tokens == 48  # type: ignore[union-attr]
    ref = b.prefill("ref", tokens(4, 50), kv_reuse=False)
    assert not np.allclose(logits, ref, atol=1e-3)


def test_reuse_without_a_usable_store_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="store"):
        HFCausalLMAdaptor(tiny_llama(0)).prefill("r", tokens(5, 20), kv_reuse=True)

    class AsyncPages:  # an AsyncClient's kv: its coroutines would never run on the engine thread
        async def exists(self, keys: Sequence[str]) -> int:
            return 0

    with pytest.raises(InvalidArgument, match="synchronous"):
        HFCausalLMAdaptor(tiny_llama(0), kv=AsyncPages())  # type: ignore[arg-type]


# ----------------------------------------------------------------- real processes and a real KV store
@pytest.fixture(scope="module")
def engines() -> Iterator[LocalCluster]:
    with running_cluster(workers=2) as cluster:
        cluster.start_instance("kv-a", "w0", ["--seed", "0"])
        cluster.start_instance("kv-b", "w1", ["--seed", "0"])
        yield cluster


def _engine(c: tc.Client, inst: str, command: str, **args: object) -> dict:
    return c.call_instance(inst, "engine", args={"command": command, **args}).result


def test_instance_b_reuses_the_prefix_instance_a_stored(engines: LocalCluster) -> None:
    shared = tokens(10, 70)
    prompt_a, prompt_b = shared + tokens(11, 30), shared + tokens(12, 40)
    with tc.connect(engines.address) as c:
        a = _engine(c, "kv-a", "prefill", request_id="a", input_ids=prompt_a, kv_reuse=True)["kv"]
        assert a["reused_tokens"] == 0 and a["prefilled_tokens"] == 100 and a["stored_pages"] == 100 // PS
        b = _engine(c, "kv-b", "prefill", request_id="b", input_ids=prompt_b, kv_reuse=True)
        r = b["kv"]
        # Pages 0-3 hold only shared tokens; page 4 (tokens 64-79) differs, so its key does too.
        assert r["matched_pages"] == r["read_pages"] == len(shared) // PS
        assert r["reused_tokens"] == len(shared) // PS * PS
        assert r["prefilled_tokens"] == len(prompt_b) - r["reused_tokens"]
        assert r["stored_pages"] == len(prompt_b) // PS - len(shared) // PS
        ref = _engine(c, "kv-b", "prefill", request_id="ref", input_ids=prompt_b, kv_reuse=False)
        assert ref["kv"]["prefilled_tokens"] == len(prompt_b) and ref["kv"]["reused_tokens"] == 0
        np.testing.assert_allclose(b["logits"], ref["logits"], atol=1e-5, rtol=1e-5)
        got = _engine(c, "kv-b", "generate", request_id="b", max_new_tokens=10)["tokens"]
        assert got == _engine(c, "kv-b", "generate", request_id="ref", max_new_tokens=10)["tokens"]
        stats = _engine(c, "kv-b", "kv_stats")
        assert stats["tokens_reused"] >= r["reused_tokens"] and stats["by_outcome"].get("hit", 0) >= 1


def test_a_wrong_layout_page_is_refused_through_an_instance(engines: LocalCluster) -> None:
    prompt = tokens(20, 40)
    layout = HFCausalLMAdaptor(tiny_llama(0)).kv_layout()  # the instances' layout: same seed, same fingerprint
    keys = page_keys(prompt, layout)
    with tc.connect(engines.address) as c:
        # A writer that ignored the layout: half a page under the prompt's first key.
        c.kv.put(keys[:1], [np.ones(layout.page_bytes // 2, np.uint8)])
        with pytest.raises(tc.errors.InvalidArgument, match="bytes"):
            _engine(c, "kv-b", "prefill", request_id="bad", input_ids=prompt, kv_reuse=True)
        ok = _engine(c, "kv-b", "prefill", request_id="plain", input_ids=prompt, kv_reuse=False)
        assert ok["kv"]["prefilled_tokens"] == len(prompt)


def test_a_missing_middle_page_in_the_store_stops_reuse_at_the_gap(engines: LocalCluster) -> None:
    prompt = tokens(30, 90)  # 5 full pages
    model_id = f"gap-{uuid.uuid4().hex[:8]}"
    with tc.connect(engines.address) as c:
        layout = HFCausalLMAdaptor(tiny_llama(0), kv_model_id=model_id).kv_layout()
        keys = page_keys(prompt, layout)

        class SkipOne:  # stores every page but the third, as if the home had evicted it
            def exists(self, ks: Sequence[str]) -> int:
                return c.kv.exists(ks)

            def get(self, ks: Sequence[str]) -> list[Any]:
                return c.kv.get(ks)

            def put(self, ks: Sequence[str], pages: Sequence[Any], **kw: Any) -> int:
                kept = [(k, p) for k, p in zip(ks, pages, strict=True) if k != keys[2]]
                return c.kv.put([k for k, _ in kept], [p for _, p in kept], **kw)

        writer = HFCausalLMAdaptor(tiny_llama(0), kv=SkipOne(), kv_reuse=True, kv_model_id=model_id)
        writer.prefill("w", prompt)
        assert c.kv.exists(keys) == 2 and c.kv.exists(keys[3:]) == 2

        reader = HFCausalLMAdaptor(tiny_llama(0), kv=c.kv, kv_reuse=True, kv_model_id=model_id)
        logits = reader.prefill("r", prompt)
        r = reader.kv_report("r")
        assert r is not None and (r.matched_pages, r.reused_tokens, r.prefilled_tokens) == (2, 32, 58)
        assert r.stored_pages == 1 and c.kv.exists(keys) == 5  # the gap is filled, the rest was there
        _same_as_recompute(reader, "r", prompt, logits)


class SlowPages(MemoryPages):
    """Puts wait for ``release`` (or fail with ``fail_put``): what a store after the reply must not wait for."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.fail_put: Exception | None = None

    def put(self, keys: Sequence[str], pages: Sequence[Any], *, ttl: float | None = None,
            layout: KVLayout | None = None) -> int:
        assert self.release.wait(30)
        if self.fail_put is not None:
            raise self.fail_put
        return super().put(keys, pages, ttl=ttl, layout=layout)


def test_pages_stored_after_the_reply_do_not_hold_up_the_prefill() -> None:
    store = SlowPages()
    a = HFCausalLMAdaptor(tiny_llama(0), kv=store, kv_reuse=True, kv_model_id="tiny-0", kv_store_in_background=True)
    prompt = tokens(3, 100)
    logits = a.prefill("a", prompt)  # returns with its store blocked: the store runs after the reply
    r = a.kv_report("a", wait=False)
    assert r is not None and r.store_pending and r.stored_pages == 0 and not store.pages
    reply = a.engine_command("prefill", {"request_id": "a2", "input_ids": prompt[:50] + tokens(4, 30)})
    assert reply["kv"]["store_pending"]  # the engine command's reply says its pages are not stored yet
    # The next turn takes over the cache a pending store reads (and request "a" with it): the store still
    # writes what "a" computed.
    a.prefill("a3", prompt + tokens(5, 20), continue_from="a")
    store.release.set()
    a.flush_kv()  # every store submitted so far
    assert not r.store_pending and r.stored_pages == 6
    r2 = a.kv_report("a2")  # waits for that request's store (done already here)
    assert r2 is not None and not r2.store_pending and r2.stored_pages == 5 - 3  # pages 0-2 were "a"'s
    ref = HFCausalLMAdaptor(tiny_llama(0), kv=MemoryPages(), kv_reuse=True, kv_model_id="tiny-0")
    ref.prefill("a", prompt)
    ref_store = ref.kv
    assert ref_store is not None
    keys = page_keys(prompt, a.kv_layout())
    assert all(np.array_equal(store.pages[k], ref_store.pages[k]) for k in keys[:6])  # type: ignore[attr-defined]
    np.testing.assert_allclose(logits, ref.prefill("b", prompt, kv_reuse=False), atol=1e-5, rtol=1e-5)
    stats = a.engine_command("kv_stats", {})  # counted once the stores are done
    assert stats["requests"] == 3 and stats["pages_stored"] == len(store.pages)


def test_a_store_that_fails_after_the_reply_leaves_the_request_served() -> None:
    store = SlowPages()
    store.fail_put = RuntimeError("disk on fire")
    store.release.set()
    a = HFCausalLMAdaptor(tiny_llama(0), kv=store, kv_reuse=True, kv_model_id="tiny-0", kv_store_in_background=True)
    prompt = tokens(6, 40)
    a.prefill("a", prompt)
    r = a.kv_report("a")
    assert r is not None and "disk on fire" in r.degraded and r.stored_pages == 0 and not r.store_pending
    assert len(a.generate("a", 4)) == 4  # the request is served from its own cache
    assert a.engine_command("kv_stats", {})["degraded"] == 1
