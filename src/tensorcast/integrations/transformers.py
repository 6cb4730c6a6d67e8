"""Loading Hugging Face transformers models from TensorCast.

Owns: building a model from an artifact's ``config.json`` on the meta device (no memory for weights)
and assigning TensorCast tensors as its parameters with ``load_state_dict(..., assign=True)``. On the
same host the tensors are copy-on-write mappings of the pool (or of the checkpoint files), so a warm
load copies nothing; ``tp=TP(rank, world)`` loads one rank's shard. ``load_into`` fills an existing
model in place instead.
"""

from __future__ import annotations

import json
from typing import Any

from tensorcast.errors import InvalidArgument
from tensorcast.views import TP

__all__ = ["from_tensorcast", "load_into"]


def _tensors(client: Any, key_or_id: str, tp: TP | None, dtype: Any) -> tuple[Any, dict[str, Any]]:
    art = client.artifact(key_or_id)
    tensors = art.view(tp=tp).tensor_dict(like="torch") if tp is not None else art.tensor_dict(like="torch")
    if dtype is not None:
        tensors = {k: v if v.dtype == dtype else v.to(dtype) for k, v in tensors.items()}
    return art, tensors


def from_tensorcast(client: Any, key_or_id: str, *, tp: TP | None = None, dtype: Any = None,
                    model_class: Any = None) -> Any:
    """A ``*ForCausalLM`` (or ``model_class``) built from the artifact's config with its weights assigned
    from TensorCast. Raises ``InvalidArgument`` if the artifact has no config or weights are missing."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    art, tensors = _tensors(client, key_or_id, tp, dtype)
    raw = art.info.meta.get("config")
    if not raw:
        raise InvalidArgument(f"artifact {art.id} has no config (register the checkpoint with from_disk)")
    cfg = json.loads(raw)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    cls = model_class or AutoModelForCausalLM
    with init_empty_weights(include_buffers=False):
        model = cls.from_config(config, dtype=dtype or getattr(config, "dtype", None) or torch.float32)
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
        missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise InvalidArgument(f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.eval()


def load_into(client: Any, key_or_id: str, model: Any, *, tp: TP | None = None) -> None:
    """Copy the artifact's tensors into an existing model's parameters in place (shapes must match)."""
    art = client.artifact(key_or_id)
    targets = model.state_dict()
    names = [n for n in art.tensor_names if n in targets]
    if tp is not None:
        art.view(tp=tp).tensor_dict_into({n: targets[n] for n in names})
    else:
        art.tensor_dict_into({n: targets[n] for n in names})
