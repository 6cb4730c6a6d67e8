"""vLLM plugins: ``--load-format tensorcast`` hands vLLM its weights from TensorCast; the KV connector
``TensorCastConnector`` (``integrations.vllm_connector``) and the ``tensorcast`` weight-transfer backend
(``integrations.vllm_transfer``, both of vLLM's factories) are registered here too.

Registered with vLLM's ``register_model_loader`` on a ``BaseModelLoader`` subclass, and exposed through
the ``vllm.general_plugins`` entry point (``tensorcast = tensorcast.integrations.vllm:register``) so that
every engine process — multiprocessing included — has it. Configuration comes from
``model_loader_extra_config`` (``address``: the cluster's gateway, default ``TENSORCAST_ADDRESS``;
``key``: an artifact key or id, default: the model directory registered in place with ``from_disk``).

Cold (nothing in memory): vLLM maps the checkpoint files where they lie (copy-on-write, through this
host's worker) and copies tensor by tensor, in file order, into its parameters: one copy, straight from
the page cache. Warm: the artifact was prefetched to this host's worker ahead of time (by the caller: an
autoscaler preparing hosts, ``tensorcast load``): nothing is read, the pool's copy is mapped.
``model_loader_extra_config["prefetch"] = True`` also has this host's worker read the checkpoint into its
pool during a cold load (parallel preads; vLLM loads behind them from the page cache), so that the next
instance here starts warm. It costs this load time and memory: on a small CPU-only host, measured, the
instance was ready later (``benchmarks/weights_load.py``). A checkpoint in object storage (``s3://``) is
always read that way first (ranged GETs into the pool), and vLLM then maps the pool's copy. Without a
worker on this host a remote one sends the bytes. Either way vLLM's own ``model.load_weights`` shards the
(full) tensors into its tensor-parallel parameters.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

__all__ = ["register"]

# A child of vLLM's logger: the plugin's lines appear with vLLM's own, in every engine process.
log = logging.getLogger("vllm.tensorcast")
_registered = False


def register() -> None:
    """vLLM plugin entry point: register the ``tensorcast`` load format and the ``TensorCastConnector`` KV
    connector (``integrations.vllm_connector``) (idempotent)."""
    global _registered
    if _registered:
        return
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with contextlib.suppress(ValueError):  # "already registered": by an earlier call in this process
        KVConnectorFactory.register_connector("TensorCastConnector", "tensorcast.integrations.vllm_connector",
                                              "TensorCastConnector")
    _register_weight_transfer()
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    @register_model_loader("tensorcast")
    class TensorCastModelLoader(BaseModelLoader):
        def download_model(self, model_config: Any) -> None:
            return None  # nothing to download: the weights are in the pool or on local disk

        def load_weights(self, model: Any, model_config: Any) -> None:
            import tensorcast as tc
            from tensorcast.errors import TensorCastError
            from tensorcast.weights.object_store import is_object_url

            t0 = time.perf_counter()
            extra = dict(self.load_config.model_loader_extra_config or {})
            address = extra.get("address") or os.environ.get("TENSORCAST_ADDRESS")
            if not address:
                raise ValueError("load_format=tensorcast needs model_loader_extra_config['address'] or "
                                 "TENSORCAST_ADDRESS")
            with tc.connect(address, token=extra.get("token")) as client:
                key = extra.get("key")
                art = client.artifact(key) if key else client.from_disk(model_config.model)
                from_bucket = is_object_url(art.info.meta.get("source", ""))
                filling = _prefetch_here(client, art) if extra.get("prefetch", from_bucket) else None
                if from_bucket and filling is not None:
                    # Object storage: this host's worker reads it with parallel ranged GETs into its pool,
                    # then vLLM maps that copy (reading it tensor by tensor through a worker is slower).
                    filling.result()
                    filling, art = None, art.refresh()
                tensors = art.tensor_dict(like="torch")
                diag = art.last_diagnostics
                loaded = model.load_weights((n, tensors[n]) for n in _file_order(art.info.meta, tensors))
                expected = {n for n, _ in model.named_parameters()}
                if loaded is not None and expected - set(loaded):
                    missing = sorted(expected - set(loaded))
                    raise ValueError(f"TensorCast artifact {art.id} lacks weights for {missing[:5]}")
                if filling is not None:
                    try:
                        filling.result()
                    except TensorCastError as exc:  # this load is done; only the next one stays cold
                        log.warning("TensorCast: the pool copy of %s for later instances failed: %s", art.id, exc)
                log.info("TensorCast: loaded %d tensors (%d bytes) from artifact %s via %s%s in %.2f seconds",
                         len(tensors), art.nbytes, art.id, diag.transport if diag else "?",
                         f" ({diag.tier} replica)" if diag else "", time.perf_counter() - t0)

    _registered = True


def _prefetch_here(client: Any, art: Any) -> Any:
    """Start making a worker on this host hold the artifact in memory (the cold read: parallel preads into
    pre-faulted pool memory, one copy that every rank of this host then shares). Returns the running
    operation, or None when a worker here already holds it (warm) or none runs here."""
    host = client.aio.host_id
    if any(r.tier == "memory" and r.host_id == host and r.alive for r in art.info.replicas):
        return None
    local = next((w for w in client.list_workers() if w.host_id == host and w.alive), None)
    return None if local is None else art.prefetch(to=local.worker_id)


def _file_order(meta: dict[str, str], tensors: dict[str, Any]) -> list[str]:
    """The tensor names in the order their bytes lie in the checkpoint files (a cold load then reads each
    file front to back, as readahead expects, instead of jumping between files); name order otherwise."""
    from tensorcast.errors import TensorCastError
    from tensorcast.weights import open_checkpoint

    source = meta.get("source", "")
    try:
        where = open_checkpoint(source).tensors if source and os.path.isdir(source) else {}
    except (OSError, ValueError, TensorCastError):
        where = {}
    return sorted(tensors, key=lambda n: (where[n].file, where[n].offset) if n in where else ("~", 0, n))


def _register_weight_transfer() -> None:
    """The ``tensorcast`` weight-transfer backend, both sides (``integrations.vllm_transfer``)."""
    try:
        from vllm.distributed.weight_transfer.factory import (
            WeightTransferEngineFactory,
            WeightTransferTrainerFactory,
        )
    except ImportError:  # a vLLM without native weight transfer
        return
    with contextlib.suppress(ValueError):
        WeightTransferEngineFactory.register_engine("tensorcast", "tensorcast.integrations.vllm_transfer",
                                                    "TensorCastWeightTransferEngine")
    with contextlib.suppress(ValueError):
        WeightTransferTrainerFactory.register_engine("tensorcast", "tensorcast.integrations.vllm_transfer_trainer",
                                                     "TensorCastTrainerWeightTransferEngine")
