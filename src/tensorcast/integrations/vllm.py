"""A vLLM model-loader plugin: ``--load-format tensorcast`` hands vLLM its weights from TensorCast.

Registered with vLLM's ``register_model_loader`` on a ``BaseModelLoader`` subclass, and exposed through
the ``vllm.general_plugins`` entry point (``tensorcast = tensorcast.integrations.vllm:register``) so that
every engine process — multiprocessing included — has it. Configuration comes from
``model_loader_extra_config`` (``address``: the cluster's gateway, default ``TENSORCAST_ADDRESS``;
``key``: an artifact key or id, default: the model directory registered in place with ``from_disk``).

Cold: the tensors are read from the checkpoint files where they lie (a worker on this host maps them;
a remote worker sends them). Warm: after ``prefetch(to=<this host's worker>)`` they are mapped from the
pool. Either way vLLM's own ``model.load_weights`` shards them into its tensor-parallel parameters.
"""

from __future__ import annotations

import logging
import os
from typing import Any

__all__ = ["register"]

log = logging.getLogger("tensorcast.vllm")
_registered = False


def register() -> None:
    """vLLM plugin entry point: register the ``tensorcast`` load format (idempotent)."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    @register_model_loader("tensorcast")
    class TensorCastModelLoader(BaseModelLoader):
        def download_model(self, model_config: Any) -> None:
            return None  # nothing to download: the weights are in the pool or on local disk

        def load_weights(self, model: Any, model_config: Any) -> None:
            import tensorcast as tc

            extra = dict(self.load_config.model_loader_extra_config or {})
            address = extra.get("address") or os.environ.get("TENSORCAST_ADDRESS")
            if not address:
                raise ValueError("load_format=tensorcast needs model_loader_extra_config['address'] or "
                                 "TENSORCAST_ADDRESS")
            with tc.connect(address, token=extra.get("token")) as client:
                key = extra.get("key")
                art = client.artifact(key) if key else client.from_disk(model_config.model)
                tensors = art.tensor_dict(like="torch")
                diag = art.last_diagnostics
                loaded = model.load_weights(iter(tensors.items()))
                expected = {n for n, _ in model.named_parameters()}
                if loaded is not None and expected - set(loaded):
                    missing = sorted(expected - set(loaded))
                    raise ValueError(f"TensorCast artifact {art.id} lacks weights for {missing[:5]}")
                log.info("loaded %d tensors (%d bytes) from TensorCast artifact %s via %s", len(tensors),
                         art.nbytes, art.id, diag.transport if diag else "?")

    _registered = True
