"""Paged prefix reuse for the HF adaptor: which prompt tokens to take from stored KV pages, which to prefill,
which pages to store, and the conversions between a transformers cache and pages.

A page is ``page_size`` tokens' K and V of every layer, shaped ``KVLayout.page_shape`` = ``(layers, 2,
kv_heads, page_size, head_dim)``, stored under ``page_keys(prompt, layout)``: page i's key names the whole
prefix ``prompt[: (i + 1) * page_size]`` (and the model and layout), so equal keys mean equal KV. Keys are
stored after rotary embedding, which is why a page is only ever used at its original positions: reused
pages are always a leading run, and the first token prefilled is at position ``reuse_tokens``.

Owns: the decisions, as pure functions (``plan_prefill``: reuse the leading stored pages but always prefill
at least the prompt's last token — a cache covering the whole prompt yields no next-token logits —,
store only the full pages not yet stored; ``leading_pages``: a read stops at the first miss or at a
page that is not exactly one page of the layout, which is ``InvalidArgument``, never wrong output), the
layout of a model (``layout_of``), the tensor conversions (``pages_from_layers``, ``layers_from_pages``)
the per-request report and running counters, and the two I/O steps around a prefill (``fetch_prefix``:
``exists`` then ``get`` of the leading pages; ``store_pages``: ``put`` of the new full pages), which turn a
transient store failure into "no reuse" for that request rather than a failed request. ``PageIO`` names
the three KV calls used (``client.kv`` and the instance runtime's bridge both provide them).
Does not own: the model's forward and cache objects (``instance.hf``), where pages live or how they are
found (``client.kv``, ``kv.*``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from tensorcast.errors import InvalidArgument, TensorCastError, clip
from tensorcast.kv.keys import KVLayout, page_keys

__all__ = ["PageIO", "PrefillPlan", "Prefix", "ReuseReport", "ReuseStats", "fetch_prefix", "layers_from_pages",
           "layout_of", "leading_pages", "pages_from_layers", "plan_prefill", "store_pages"]

log = logging.getLogger("tensorcast.instance")


class PageIO(Protocol):
    """The KV-page calls prefix reuse makes (``client.kv`` has them, and so does an instance runtime's bridge)."""

    def exists(self, keys: Sequence[str]) -> int: ...

    def get(self, keys: Sequence[str]) -> list[Any]: ...

    def put(self, keys: Sequence[str], pages: Sequence[Any], *, ttl: float | None = None,
            layout: KVLayout | None = None) -> int: ...


# ----------------------------------------------------------------- decisions (pure)
@dataclass(frozen=True)
class PrefillPlan:
    """How one prompt is prefilled given ``stored`` leading pages present in the store."""

    prompt_tokens: int
    page_size: int
    reuse_tokens: int  # leading tokens whose KV come from pages
    read_pages: int  # leading pages to read (the last may be used in part)
    store_first: int  # pages [store_first, store_end) are written after the prefill
    store_end: int

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens - self.reuse_tokens


def plan_prefill(prompt_tokens: int, page_size: int, stored: int) -> PrefillPlan:
    """Reuse the ``stored`` leading pages, but never the prompt's last token: the forward pass over at least
    one token is what yields the next-token logits (and ``generate`` misbehaves on a cache covering the whole
    prompt), so a prompt covered by pages entirely reuses ``prompt_tokens - 1`` tokens, the last page cropped.
    Stores the prompt's full pages from the first one not stored; a partial tail page is never stored (its
    key would name tokens that have not been seen yet)."""
    if page_size < 1:
        raise InvalidArgument(f"page_size must be at least 1, got {page_size}")
    if prompt_tokens < 1:
        raise InvalidArgument("a prompt needs at least one token")
    full = prompt_tokens // page_size
    stored = max(0, min(stored, full))
    reuse = min(stored * page_size, prompt_tokens - 1)
    return PrefillPlan(prompt_tokens, page_size, reuse, math.ceil(reuse / page_size), stored, full)


def leading_pages(pages: Sequence[Any], layout: KVLayout, keys: Sequence[str]) -> list[Any]:
    """The leading run of pages that are present (``None``: a miss, e.g. evicted since ``exists``). A present
    page that is not exactly ``layout.page_bytes`` bytes was written under another layout (or is corrupt):
    ``InvalidArgument``, since guessing would put wrong K/V into the cache. Keys are salted with the layout,
    so only a writer that ignored the layout can cause this; a same-sized page of another dtype cannot be
    told apart from bytes alone."""
    out: list[Any] = []
    for key, page in zip(keys, pages, strict=True):
        if page is None:
            break
        nbytes = int(getattr(page, "nbytes", -1))
        if nbytes != layout.page_bytes:
            raise InvalidArgument(f"KV page {clip(key)} has {nbytes} bytes; a page of layout {layout.layout_id} "
                                  f"({layout.page_shape}, {layout.dtype}) has {layout.page_bytes}")
        out.append(page)
    return out


def layout_of(config: Any, dtype: str, model_id: str, page_size: int) -> KVLayout:
    """The page layout of a decoder-only transformers model: every layer full attention, ``num_key_value_heads``
    heads of ``head_dim``. Models with sliding-window or other non-full layers are refused: their caches do not
    hold every token's K/V, so pages cut from them would be wrong."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = set(getattr(cfg, "layer_types", None) or ("full_attention",))
    if kinds != {"full_attention"}:
        raise InvalidArgument(f"KV page reuse needs full-attention layers only, this model has {sorted(kinds)}")
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return KVLayout(model_id, int(cfg.num_hidden_layers), kv_heads, head_dim, dtype, page_size)


# ----------------------------------------------------------------- tensor conversions
def _check_layers(layers: Sequence[tuple[Any, Any]], layout: KVLayout, tokens: int) -> None:
    want = (1, layout.kv_heads, tokens, layout.head_dim)
    if len(layers) != layout.layers:
        raise InvalidArgument(f"cache has {len(layers)} layers, the KV layout {layout.layers}")
    for i, (k, v) in enumerate(layers):
        for name, t in (("keys", k), ("values", v)):
            if tuple(t.shape) != want or str(t.dtype).removeprefix("torch.") != layout.dtype:
                raise InvalidArgument(f"cache layer {i} {name}: {tuple(t.shape)} {t.dtype}, expected {want} "
                                      f"{layout.dtype} (batch 1, every token cached)")


def pages_from_layers(layers: Sequence[tuple[Any, Any]], first: int, end: int, layout: KVLayout,
                      tokens: int) -> Any:
    """Pages ``[first, end)`` of a cache given as per-layer ``(keys, values)`` shaped ``[1, kv_heads, tokens,
    head_dim]``: one contiguous tensor ``[end - first, *layout.page_shape]`` (a fresh copy, so the cache may
    grow or go away while the pages are being stored; each row is one contiguous page)."""
    import torch

    _check_layers(layers, layout, tokens)
    if not 0 <= first <= end <= tokens // layout.page_size:
        raise InvalidArgument(f"pages [{first}, {end}) are not full pages of a {tokens}-token cache")
    n, ps, h, d = end - first, layout.page_size, layout.kv_heads, layout.head_dim
    out = torch.empty((n, *layout.page_shape), dtype=layers[0][0].dtype)
    for i, (k, v) in enumerate(layers):
        for j, t in enumerate((k, v)):
            # [h, n*ps, d] -> [n, h, ps, d]: one strided copy per layer and K/V, not one per page.
            out[:, i, j] = t[0, :, first * ps : end * ps].reshape(h, n, ps, d).permute(1, 0, 2, 3)
    return out


def layers_from_pages(pages: Sequence[Any], tokens: int, layout: KVLayout) -> list[tuple[Any, Any]]:
    """Per-layer ``(keys, values)`` shaped ``[1, kv_heads, tokens, head_dim]`` from leading pages (uint8 arrays
    or tensors of ``layout.page_bytes`` bytes each), cropped to ``tokens``. Fresh contiguous tensors: the cache
    grows them, while the page buffers belong to the caller."""
    import numpy as np
    import torch

    if not 0 <= tokens <= len(pages) * layout.page_size:
        raise InvalidArgument(f"{len(pages)} pages cannot cover {tokens} tokens")
    if not pages:
        return []
    dtype = getattr(torch, layout.dtype)
    views = []
    for p in pages:
        raw = p if isinstance(p, torch.Tensor) else torch.from_numpy(np.asarray(p).reshape(-1))
        views.append(raw.reshape(-1).view(torch.uint8).view(dtype).reshape(layout.page_shape))
    out = []
    for i in range(layout.layers):
        kv = [torch.cat([p[i, j] for p in views], dim=1)[:, :tokens].unsqueeze(0).contiguous() for j in (0, 1)]
        out.append((kv[0], kv[1]))
    return out


# ----------------------------------------------------------------- reports
@dataclass
class ReuseReport:
    """What prefix reuse did for one request (returned with the ``prefill`` engine command)."""

    enabled: bool
    prompt_tokens: int
    page_size: int = 0
    matched_pages: int = 0  # leading pages ``exists`` found
    read_pages: int = 0  # leading pages read and used
    reused_tokens: int = 0
    prefilled_tokens: int = 0  # tokens the forward pass actually ran on
    stored_pages: int = 0  # pages newly written by this request
    degraded: str = ""  # a store error that made this request skip reuse or storing (served anyway)
    lookup_s: float = 0.0
    read_s: float = 0.0
    prefill_s: float = 0.0
    store_s: float = 0.0
    store_pending: bool = False  # stored after the reply (``kv_store_in_background``), not done yet

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ReuseStats:
    """Running counters over an adaptor's requests."""

    requests: int = 0
    pages_matched: int = 0
    pages_read: int = 0
    pages_stored: int = 0
    tokens_reused: int = 0
    tokens_prefilled: int = 0
    degraded: int = 0
    by_outcome: dict[str, int] = field(default_factory=dict)  # "hit" / "miss" / "off"

    def add(self, r: ReuseReport) -> None:
        self.requests += 1
        self.pages_matched += r.matched_pages
        self.pages_read += r.read_pages
        self.pages_stored += r.stored_pages
        self.tokens_reused += r.reused_tokens
        self.tokens_prefilled += r.prefilled_tokens
        self.degraded += bool(r.degraded)
        outcome = "off" if not r.enabled else "hit" if r.reused_tokens else "miss"
        self.by_outcome[outcome] = self.by_outcome.get(outcome, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# ----------------------------------------------------------------- I/O around a prefill
@dataclass
class Prefix:
    """A request's stored prefix, as fetched: its page keys, the plan, and the reused K/V per layer."""

    keys: list[str]
    plan: PrefillPlan
    layers: list[tuple[Any, Any]]


def _degrade(report: ReuseReport, what: str, exc: TensorCastError) -> None:
    # A cache that is briefly unreachable or full must not fail the request: it is served by recompute.
    report.degraded = f"{what}: {exc}"
    log.warning("KV page %s failed, serving without it: %s", what, exc)


def fetch_prefix(kv: PageIO, layout: KVLayout, tokens: Sequence[int], report: ReuseReport) -> Prefix:
    """Find the longest stored prefix of ``tokens`` (``exists``), read those pages (``get``) and turn them into
    per-layer K/V. Pages evicted between the two calls shorten the prefix (reuse stops at the first miss); a
    page of the wrong size is ``InvalidArgument``; retryable store errors mean no reuse (``report.degraded``)."""
    keys = page_keys(tokens, layout)
    t0 = time.perf_counter()
    matched = 0
    try:
        matched = kv.exists(keys) if keys else 0
    except TensorCastError as exc:
        if not exc.retryable:
            raise
        _degrade(report, "lookup", exc)
    plan = plan_prefill(len(tokens), layout.page_size, matched)
    t1 = time.perf_counter()
    pages: list[Any] = []
    if plan.read_pages:
        want = keys[: plan.read_pages]
        try:
            pages = leading_pages(kv.get(want), layout, want)
        except TensorCastError as exc:
            if not exc.retryable:
                raise
            _degrade(report, "read", exc)
        if len(pages) < plan.read_pages:
            plan = plan_prefill(len(tokens), layout.page_size, len(pages))
    layers = layers_from_pages(pages[: plan.read_pages], plan.reuse_tokens, layout)
    report.matched_pages, report.read_pages, report.reused_tokens = matched, plan.read_pages, plan.reuse_tokens
    report.lookup_s, report.read_s = t1 - t0, time.perf_counter() - t1
    return Prefix(keys, plan, layers)


def store_pages(kv: PageIO, layout: KVLayout, prefix: Prefix, layers: Sequence[tuple[Any, Any]],
                ttl: float | None, report: ReuseReport) -> None:
    """Write the prompt's full pages that were not read (``prefix.plan``), cut from the prefilled cache
    ``layers``; existing keys are skipped by the store (same key, same bytes)."""
    plan = prefix.plan
    if plan.store_end <= plan.store_first:
        return
    t0 = time.perf_counter()
    pages = pages_from_layers(layers, plan.store_first, plan.store_end, layout, plan.prompt_tokens)
    try:
        report.stored_pages = kv.put(prefix.keys[plan.store_first : plan.store_end], list(pages), ttl=ttl,
                                     layout=layout)
    except TensorCastError as exc:
        if not exc.retryable:
            raise
        _degrade(report, "store", exc)
    report.store_s = time.perf_counter() - t0
