"""Tensor-parallel sharding rules for the Llama, Qwen2/Qwen3 and Qwen3-MoE families, by ``model_type``.

Column-parallel (split dim 0): q/k/v projections, gate/up projections, fused ``qkv_proj`` and
``gate_up_proj`` (split per part: each rank gets its slice of every part), vocab-parallel
``embed_tokens`` and ``lm_head``, and their biases. Row-parallel (split dim 1): ``o_proj``, ``down_proj``.
Replicated: norms, rotary buffers, the MoE router (``mlp.gate``), anything else 1-D.

Experts (Qwen3-MoE): every rank holds every expert, tensor-parallel inside each expert (gate/up split on
dim 0, down on dim 1) — what vLLM does for MoE with TP and no expert parallelism. Expert parallelism
(whole experts per rank) is a different rule set a user can register.

A fused ``qkv_proj`` ([q; k; v] with grouped-query attention) needs the part sizes, which depend on the
config: ``rules_for(model_type, config)`` adds ``Fused(0, sizes=(q, k, v))`` from the head counts.
Extend with ``register_rules(model_type, TPRules(...))``.
"""

from __future__ import annotations

from typing import Any

from tensorcast.errors import InvalidArgument, clip
from tensorcast.views import Fused, RuleSpec, TPRules

__all__ = ["register_rules", "rules_for"]


def _dense_rules() -> list[tuple[str, RuleSpec]]:
    col = 0
    row = 1
    return [
        ("re:.*\\.(q_proj|k_proj|v_proj)\\.(weight|bias)", col),
        ("re:.*\\.(gate_proj|up_proj)\\.weight", col),
        ("re:.*\\.gate_up_proj\\.weight", Fused(dim=0, parts=2)),  # fused [gate; up]
        ("re:.*\\.experts\\.\\d+\\.(gate_proj|up_proj)\\.weight", col),
        ("re:.*\\.experts\\.\\d+\\.down_proj\\.weight", row),
        ("re:.*\\.(o_proj|down_proj)\\.weight", row),
        ("re:.*\\.mlp\\.gate\\.weight", "replicated"),  # the MoE router
        ("re:(model\\.)?embed_tokens\\.weight", col),  # vocab-parallel
        ("lm_head.weight", col),
        ("re:.*norm.*", "replicated"),
        ("*", "replicated"),
    ]


_RULES: dict[str, TPRules] = {}


def register_rules(model_type: str, rules: TPRules) -> None:
    _RULES[model_type] = rules


for _mt in ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral"):
    register_rules(_mt, TPRules(_dense_rules()))


def rules_for(model_type: str, config: dict[str, Any] | None = None) -> TPRules:
    """The rule set for ``model_type``; with ``config``, fused qkv part sizes come from its head counts."""
    try:
        rules = _RULES[model_type]
    except KeyError:
        raise InvalidArgument(f"no tensor-parallel rules for model_type {clip(model_type)}; known: {sorted(_RULES)} "
                              "(register_rules() adds one)") from None
    if config and "num_attention_heads" in config and "hidden_size" in config:
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        qkv = Fused(dim=0, sizes=(heads * head_dim, kv_heads * head_dim, kv_heads * head_dim))
        return TPRules([("re:.*\\.qkv_proj\\.weight", qkv), *rules.items], default=rules.default)
    return rules
