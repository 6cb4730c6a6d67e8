"""An instance adaptor for Hugging Face transformers causal LMs on CPU (Llama/Qwen2 families).

Owns: per-request KV caches of a ``*ForCausalLM``, exporting one as tensors (``publish``), rebuilding it
in another process (``hydrate``) so decoding continues exactly as if that process had prefilled the
prompt, copying weights into the parameters in place (``transform_into``), and a few engine commands
(``prefill``, ``next_logits``, ``generate``, ``drop``, ``kv_stats``) the demo, tests and examples drive.

Paged prefix reuse (``kv_reuse=True``, or per request): a prefill looks up the longest stored prefix of the
prompt in the KV-page store, loads those pages into the request's cache, prefills only the rest, then stores
the prompt's new full pages; each prefill reports what it reused (``ReuseReport``). The decisions and the
page format are ``instance.hf_pages``; the store is ``kv=`` (e.g. ``client.kv``) or, under ``serve``, the
instance runtime's client (``bind_kv``). Pages are keyed by a model id: ``kv_model_id`` (e.g. repo@revision),
else a fingerprint of the config and weights, recomputed after ``transform_into``.

Pages stored after the reply (``kv_store_in_background=True``): the new full pages are written by a thread
of the adaptor's once the prefill has returned, so its first token does not wait for the page store
(``instance.hf_store_behind``); the ``prefill`` engine command's report then says ``store_pending``, and
``kv_report`` (and ``kv_stats``) wait for the store. A later turn elsewhere that arrives first finds fewer
pages stored, as with any write-back cache.

Local prefix cache (``continue_from``, per request): a prefill may name an earlier request on this instance
whose KV cache it starts from, as a real engine's prefix cache would. The new request *takes over* that
request's cache — the earlier request is removed, its cache cropped to the longest common prefix of its tokens
(prompt plus generated) and the new prompt, and only the rest is forwarded. Taking over rather than copying
costs no memory or time proportional to the context, and an agent's next turn supersedes its previous one; a
caller that still needs the earlier request must not name it. The match is the longest common prefix rather
than "the whole earlier request is a prefix", since the next prompt of a session need not repeat the exact
tokens the model generated (a replayed workload's outputs are drawn, not the model's); every cached token
kept is one whose K/V equals a recompute's. No match (unknown request, or nothing in common) falls back to
the normal path (shared pages if ``kv_reuse``, else full recompute); the report (``PrefillReport``) says how
many tokens came from the local cache, the shared store, or were computed. Memory stays bounded only if
callers ``drop`` requests they no longer need (e.g. a session's previous turn left on another instance).

Layout of a published request (all contiguous, so equal caches give equal bytes and the same artifact):
``input_ids`` (the whole prompt, int64), and ``layers.{i}.keys`` / ``layers.{i}.values`` shaped
``[batch, kv_heads, tokens - 1, head_dim]`` — the cache of every prompt token but the last. The receiver
runs the last token itself, which yields the next-token logits (keys are stored after rotary embedding,
so pages are only valid at their original positions: ``position_ids`` start at the cached length).
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tensorcast.errors import InvalidArgument, NotFound, clip
from tensorcast.instance.adaptor import InstanceLoad
from tensorcast.instance.hf_pages import (
    PageIO,
    Prefix,
    ReuseReport,
    ReuseStats,
    fetch_prefix,
    layout_of,
    plan_prefill,
    store_pages,
)
from tensorcast.instance.hf_store_behind import StoreBehind
from tensorcast.kv.keys import KVLayout, page_keys

__all__ = ["HFCausalLMAdaptor", "PrefillReport", "tiny_llama"]


def _sync_kv(kv: PageIO) -> PageIO:
    # Adaptor calls run on an engine thread and block on the store: an ``AsyncClient``'s coroutines would
    # never run there. Refuse them up front rather than fail at the first request.
    if inspect.iscoroutinefunction(getattr(kv, "exists", None)):
        raise InvalidArgument("kv must make synchronous calls: pass a Client's kv (tc.connect(...).kv), "
                              "not an AsyncClient's")
    return kv


@dataclass
class PrefillReport(ReuseReport):
    """A prefill's ``ReuseReport`` plus the local prefix cache: ``local_tokens`` came from the cache of
    ``continued_from`` (``""``: none was used), ``reused_tokens`` from the shared page store, and
    ``prefilled_tokens`` were computed; the three add up to ``prompt_tokens``."""

    local_tokens: int = 0
    continued_from: str = ""


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class _Request:
    input_ids: Any  # LongTensor [1, n]
    cache: Any  # DynamicCache covering input_ids[:, :cached]
    cached: int
    logits: Any = None  # next-token logits once computed
    kv: ReuseReport | None = None  # what prefix reuse did for its prefill


class HFCausalLMAdaptor:
    engine = "transformers"

    def __init__(self, model: Any, *, kv_tokens_capacity: int = 1 << 20, kv: PageIO | None = None,
                 kv_reuse: bool = False, kv_page_size: int = 16, kv_model_id: str | None = None,
                 kv_page_ttl: float | None = None, kv_store_in_background: bool = False) -> None:
        self.model = model.eval()
        # transformers renamed ``past_key_values`` to ``cache`` (5.2x); speak whichever this version takes.
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.config = model.config
        self.kv_tokens_capacity = kv_tokens_capacity
        self.requests: dict[str, _Request] = {}
        self._lock = threading.Lock()
        self.kv = _sync_kv(kv) if kv is not None else None
        self.kv_reuse = kv_reuse
        self.kv_page_size = kv_page_size
        self.kv_model_id = kv_model_id
        self.kv_page_ttl = kv_page_ttl
        self.kv_stats = ReuseStats()
        self._stats_lock = threading.Lock()
        # Pages stored after the prefill replied (its first token does not wait for them), or before.
        self._behind = StoreBehind(self.kv_stats, self._stats_lock) if kv_store_in_background else None
        self.forwarded_tokens = 0  # every token a forward pass ran on: what reuse saves is visible here
        self._layout: KVLayout | None = None
        if kv_reuse:
            self.kv_layout()  # refuse a model whose caches cannot be paged now, not at the first request

    # ----------------------------------------------------------------- helpers
    def _forward(self, ids: Any, cache: Any, start: int) -> Any:
        import torch

        n = ids.shape[1]
        self.forwarded_tokens += n
        with torch.no_grad():
            out = self.model(
                input_ids=ids,
                use_cache=True,
                position_ids=torch.arange(start, start + n).unsqueeze(0),
                attention_mask=torch.ones(1, start + n, dtype=torch.long),
                **{self._cache_kw: cache},
            )
        return out, getattr(out, "cache", None) or out.past_key_values

    def _new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    def _request(self, request_id: str) -> _Request:
        try:
            return self.requests[request_id]
        except KeyError:
            raise NotFound(f"no request {clip(request_id)} on this instance") from None

    # ----------------------------------------------------------------- KV pages
    def bind_kv(self, kv: PageIO) -> None:
        """Called by the instance runtime with its client's KV calls; a store given to the constructor wins."""
        if self.kv is None:
            self.kv = _sync_kv(kv)

    def kv_layout(self) -> KVLayout:
        """The page layout of this model (its model id fingerprints the weights unless ``kv_model_id`` is set)."""
        if self._layout is None:
            dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
            model_id = self.kv_model_id or self._fingerprint()
            self._layout = layout_of(self.config, dtype, model_id, self.kv_page_size)
        return self._layout

    def _fingerprint(self) -> str:
        # Pages of other weights would be wrong K/V under the same token keys: without a model id, name the
        # model by its config and every parameter's bytes (hashed once; transform_into invalidates it).
        import blake3
        import torch

        h = blake3.blake3(self.config.to_json_string(use_diff=False).encode())
        for name, t in sorted(self.model.state_dict().items()):
            h.update(name.encode())
            h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        return f"hf-weights:{h.hexdigest()[:32]}"

    @staticmethod
    def _layers(cache: Any) -> list[tuple[Any, Any]]:
        return [(layer.keys, layer.values) for layer in cache.layers]

    # ----------------------------------------------------------------- engine commands
    def prefill(self, request_id: str, input_ids: list[int], *, kv_reuse: bool | None = None,
                continue_from: str | None = None) -> list[float]:
        """Prefill a prompt; with KV reuse (``kv_reuse``, default the adaptor's), take its longest stored prefix
        from the page store and store its new full pages. With ``continue_from`` (a request on this instance),
        take over that request's cache for the longest common prefix first (see the module docstring).
        ``kv_report(request_id)`` says what came from where."""
        import torch

        input_ids = [int(t) for t in input_ids]  # page keys hash the tokens as plain ints
        ids = torch.tensor([input_ids], dtype=torch.long)
        if ids.shape[1] < 2:
            raise InvalidArgument("a prompt needs at least two tokens")
        reuse = self.kv_reuse if kv_reuse is None else kv_reuse
        if reuse and self.kv is None:
            raise InvalidArgument("KV reuse needs a KV-page store: pass kv= or serve the adaptor")
        report = PrefillReport(enabled=reuse, prompt_tokens=ids.shape[1])
        cache, start = self._new_cache(), 0
        kv, layout, prefix = self.kv, None, None
        local = self._take_over(continue_from, input_ids) if continue_from is not None else None
        if local is not None:
            cache, start = local
            report.local_tokens, report.continued_from = start, str(continue_from)
            if reuse:
                # The shared store is not read (the local cache already holds the prefix), but this prompt's
                # new full pages are still stored, so a later turn elsewhere can fetch them. Pages of the
                # taken-over prefix were stored by the turn that computed them.
                layout = self.kv_layout()
                report.page_size = layout.page_size
                prefix = Prefix(page_keys(input_ids, layout), plan_prefill(len(input_ids), layout.page_size,
                                                                            start // layout.page_size), [])
        elif reuse:
            assert kv is not None  # checked above
            layout = self.kv_layout()
            report.page_size = layout.page_size
            prefix = fetch_prefix(kv, layout, input_ids, report)
            for i, (k, v) in enumerate(prefix.layers):
                cache.update(k, v, i)
            start = prefix.plan.reuse_tokens
        t0, before = time.perf_counter(), self.forwarded_tokens
        out, cache = self._forward(ids[:, start:], cache, start)
        report.prefill_s, report.prefilled_tokens = time.perf_counter() - t0, self.forwarded_tokens - before
        behind = False
        if kv is not None and layout is not None and prefix is not None:
            store = functools.partial(store_pages, kv, layout, prefix, self._layers(cache), self.kv_page_ttl, report)
            if self._behind is not None:  # the cache's tensors never change from here on (see hf_store_behind)
                self._behind.submit(request_id, store, report)
                behind = True
            else:
                store()
        req = _Request(ids, cache, ids.shape[1], out.logits[0, -1].clone(), report)
        self.requests[request_id] = req
        if not behind:
            with self._stats_lock:
                self.kv_stats.add(report)
        return [float(x) for x in req.logits]

    def _take_over(self, previous_id: str, input_ids: list[int]) -> tuple[Any, int] | None:
        """``previous_id``'s cache cropped to its longest common prefix with ``input_ids`` (never the whole
        prompt: the last token is forwarded for the logits), removing ``previous_id``; None, leaving it in
        place, if it is not on this instance or shares no token with the prompt."""
        prev = self.requests.get(previous_id)
        if prev is None:
            return None
        held = [int(t) for t in prev.input_ids[0, : prev.cached].tolist()]  # tokens the cache covers
        keep = min(_common_prefix(held, input_ids), len(input_ids) - 1)
        if keep < 1:
            return None
        del self.requests[previous_id]
        # A negative count removes that many tokens on every transformers version in range (a positive one
        # meant "keep this many" until 5.19 and is refused since).
        surplus = prev.cache.get_seq_length() - keep
        if surplus > 0:
            prev.cache.crop(-surplus)
        return prev.cache, keep

    def kv_report(self, request_id: str, *, wait: bool = True) -> ReuseReport | None:
        """What prefix reuse did for the request's prefill (None: hydrated, not prefilled here); with pages
        stored in the background, once they are (``wait=False``: as it stands, ``store_pending`` says)."""
        req = self._request(request_id)
        if wait and self._behind is not None:
            self._behind.wait(request_id)
        return req.kv

    def flush_kv(self, timeout: float | None = None) -> None:
        """Until every page store submitted so far is done (none run in the background: at once)."""
        if self._behind is not None:
            self._behind.wait(timeout=timeout)

    def next_logits(self, request_id: str) -> list[float]:
        req = self._request(request_id)
        if req.logits is None:
            # Hydrated: the cache covers all but the last prompt token, which we run now.
            out, _ = self._forward(req.input_ids[:, req.cached :], req.cache, req.cached)
            req.cached = req.input_ids.shape[1]
            req.logits = out.logits[0, -1].clone()
        return [float(x) for x in req.logits]

    def generate(self, request_id: str, max_new_tokens: int) -> list[int]:
        """Greedy decoding from the request's current state."""
        import torch

        self.next_logits(request_id)
        req = self._request(request_id)
        tokens: list[int] = []
        for _ in range(max_new_tokens):
            tok = int(torch.argmax(req.logits))
            tokens.append(tok)
            step = torch.tensor([[tok]], dtype=torch.long)
            out, _ = self._forward(step, req.cache, req.cached)
            req.input_ids = torch.cat([req.input_ids, step], dim=1)
            req.cached += 1
            req.logits = out.logits[0, -1].clone()
        return tokens

    def engine_command(self, command: str, args: Mapping[str, Any]) -> dict[str, Any]:
        if command == "prefill":
            rid, reuse, previous = str(args["request_id"]), args.get("kv_reuse"), args.get("continue_from")
            logits = self.prefill(rid, list(args["input_ids"]), kv_reuse=None if reuse is None else bool(reuse),
                                  continue_from=None if previous is None else str(previous))
            report = self.kv_report(rid, wait=False)  # the reply does not wait for pages stored after it
            return {"logits": logits, "kv": report.as_dict() if report is not None else {}}
        if command == "kv_stats":
            self.flush_kv()
            with self._stats_lock:
                return self.kv_stats.as_dict()
        if command == "next_logits":
            return {"logits": self.next_logits(str(args["request_id"]))}
        if command == "generate":
            return {"tokens": self.generate(str(args["request_id"]), int(args.get("max_new_tokens", 8)))}
        if command == "drop":
            self.requests.pop(str(args["request_id"]), None)
            return {}
        raise InvalidArgument(f"unknown engine command {clip(command)}")

    # ----------------------------------------------------------------- adaptor operations
    def publish(self, request_id: str, options: Mapping[str, Any]) -> dict[str, Any]:
        req = self._request(request_id)
        keep = req.input_ids.shape[1] - 1
        out: dict[str, Any] = {"input_ids": req.input_ids[0].contiguous().clone()}
        for i, layer in enumerate(req.cache.layers):
            out[f"layers.{i}.keys"] = layer.keys[:, :, :keep].contiguous()
            out[f"layers.{i}.values"] = layer.values[:, :, :keep].contiguous()
        return out

    def hydrate(self, request_id: str, tensors: Mapping[str, Any], options: Mapping[str, Any]) -> None:
        n_layers = self.config.num_hidden_layers
        if "input_ids" not in tensors:
            raise InvalidArgument("published KV is missing input_ids")
        cache = self._new_cache()
        for i in range(n_layers):
            try:
                k, v = tensors[f"layers.{i}.keys"], tensors[f"layers.{i}.values"]
            except KeyError as exc:
                raise InvalidArgument(f"published KV is missing {exc.args[0]}") from None
            # Clone: the cache grows these tensors, while the mapped ones belong to the pool mapping.
            cache.update(k.clone(), v.clone(), i)
        ids = tensors["input_ids"].reshape(1, -1).clone()
        cached = int(tensors["layers.0.keys"].shape[2])
        if cached != ids.shape[1] - 1:
            raise InvalidArgument(f"KV covers {cached} tokens, expected {ids.shape[1] - 1}")
        self.requests[request_id] = _Request(ids, cache, cached)

    def transform_into(self, tensors: Mapping[str, Any], options: Mapping[str, Any]) -> None:
        import torch

        params = self.model.state_dict()
        unknown = sorted(set(tensors) - set(params))
        if unknown and not options.get("ignore_unknown"):
            raise InvalidArgument(f"weights for unknown parameters: {unknown[:5]}")
        with torch.no_grad():
            for name, src in tensors.items():
                if name not in params:
                    continue
                dst = params[name]
                if tuple(dst.shape) != tuple(src.shape):
                    raise InvalidArgument(f"{name}: shape {tuple(src.shape)} != parameter {tuple(dst.shape)}")
                dst.copy_(src)
        self.weights_changed()

    def weights_changed(self) -> None:
        """The parameters were rewritten in place (``transform_into``, or a weight binding's swap, which calls
        this through ``instance.binding.BindingAdaptor``): new weights, new fingerprint for KV pages (unless
        ``kv_model_id`` names the model)."""
        self._layout = None

    def load(self) -> InstanceLoad:
        used = sum(r.cached for r in self.requests.values())
        return InstanceLoad(running=len(self.requests), waiting=0, kv_tokens_used=used,
                            kv_tokens_capacity=self.kv_tokens_capacity)


def tiny_llama(seed: int = 0, *, layers: int = 2, hidden: int = 64, vocab: int = 256) -> Any:
    """A small LlamaForCausalLM with seeded random weights (float32): no downloads."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()  # type: ignore[no-untyped-call]
