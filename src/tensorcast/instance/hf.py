"""An instance adaptor for Hugging Face transformers causal LMs on CPU (Llama/Qwen2 families).

Owns: per-request KV caches of a ``*ForCausalLM``, exporting one as tensors (``publish``), rebuilding it
in another process (``hydrate``) so decoding continues exactly as if that process had prefilled the
prompt, copying weights into the parameters in place (``transform_into``), and a few engine commands
(``prefill``, ``next_logits``, ``generate``, ``drop``) the demo, tests and examples drive.

Layout of a published request (all contiguous, so equal caches give equal bytes and the same artifact):
``input_ids`` (the whole prompt, int64), and ``layers.{i}.keys`` / ``layers.{i}.values`` shaped
``[batch, kv_heads, tokens - 1, head_dim]`` — the cache of every prompt token but the last. The receiver
runs the last token itself, which yields the next-token logits (keys are stored after rotary embedding,
so pages are only valid at their original positions: ``position_ids`` start at the cached length).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tensorcast.errors import InvalidArgument, NotFound, clip
from tensorcast.instance.adaptor import InstanceLoad

__all__ = ["HFCausalLMAdaptor", "tiny_llama"]


@dataclass
class _Request:
    input_ids: Any  # LongTensor [1, n]
    cache: Any  # DynamicCache covering input_ids[:, :cached]
    cached: int
    logits: Any = None  # next-token logits once computed


class HFCausalLMAdaptor:
    engine = "transformers"

    def __init__(self, model: Any, *, kv_tokens_capacity: int = 1 << 20) -> None:
        self.model = model.eval()
        # transformers renamed ``past_key_values`` to ``cache`` (5.2x); speak whichever this version takes.
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.config = model.config
        self.kv_tokens_capacity = kv_tokens_capacity
        self.requests: dict[str, _Request] = {}
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- helpers
    def _forward(self, ids: Any, cache: Any, start: int) -> Any:
        import torch

        n = ids.shape[1]
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

    # ----------------------------------------------------------------- engine commands
    def prefill(self, request_id: str, input_ids: list[int]) -> list[float]:
        import torch

        ids = torch.tensor([input_ids], dtype=torch.long)
        if ids.shape[1] < 2:
            raise InvalidArgument("a prompt needs at least two tokens")
        out, cache = self._forward(ids, self._new_cache(), 0)
        req = _Request(ids, cache, ids.shape[1], out.logits[0, -1].clone())
        self.requests[request_id] = req
        return [float(x) for x in req.logits]

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
            return {"logits": self.prefill(str(args["request_id"]), list(args["input_ids"]))}
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
