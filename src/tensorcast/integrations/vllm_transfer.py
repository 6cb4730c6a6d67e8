"""vLLM's native weight transfer with TensorCast as its backend: the rollout side (``backend: "tensorcast"``).

Turned on with ``vllm serve MODEL --weight-transfer-config '{"backend": "tensorcast"}'`` (or
``LLM(..., weight_transfer_config={"backend": "tensorcast"})``); the ``vllm.general_plugins`` entry point
(``integrations.vllm.register``) registers this engine with ``WeightTransferEngineFactory`` and the trainer's
(``integrations.vllm_transfer_trainer``) with ``WeightTransferTrainerFactory``. A trainer then drives vLLM's own
routes (``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``; offline ``LLM`` has the same methods), each run on every worker of the engine:

- init: ``{"address": GATEWAY, "model": NAME}`` (``timeout``, ``verify`` optional). The worker connects to the
  cluster with its own credential (``TENSORCAST_TOKEN`` of the vLLM process): no secret rides the RL routes.
- start: nothing; the model is not touched.
- update: ``{"version": N}``: version N of the model (``{model}@v{N}``, ``client.publisher``) is read from the
  pool (same host: its pages mapped, no copy; elsewhere fetched) and every tensor checked against its content
  digest (what landed is what was published), then kept staged. The engine serves the old weights meanwhile.
- finish: the staged version goes through vLLM's layerwise reload (the path its own engines take: vLLM shards,
  fuses and repacks each tensor for this rank, parameters keep their addresses) within this one call, between
  two steps of the engine: no step sees a mix. The trainer pauses the engine around it (``/pause``, in-flight
  requests drained, the prefix cache cleared: cached KV came from the old weights) and resumes it after.

A failed update (no such version, a digest mismatch, a deadline: ``update`` raises) leaves the old weights
serving untouched; ``finish`` without a staged version raises before touching the model. Every read has the
init's ``timeout`` as its deadline: nothing waits on a peer forever. Staged versions must keep the names,
dtypes and shapes of the first one loaded (``rollout_checks.check_compatible``), so a wrong model is refused before the
reload. Does not own: publishing (``client.publisher``, ``integrations.vllm_transfer_trainer``), vLLM's reload.

GPU: tensors are handed to vLLM on the host (mapped pool pages); vLLM's loaders copy them to the device.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

try:  # vLLM is optional: the checks below are tested without it
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
except ImportError:  # pragma: no cover - exercised where vLLM is missing
    WeightTransferEngine = WeightTransferInitInfo = WeightTransferUpdateInfo = object

from tensorcast.errors import InvalidArgument, clip
from tensorcast.integrations.rollout_checks import Layout, check_compatible, check_digests, layout_of

__all__ = ["TensorCastInitInfo", "TensorCastUpdateInfo", "TensorCastWeightTransferEngine"]

log = logging.getLogger("vllm.tensorcast")

@dataclass
class TensorCastInitInfo(WeightTransferInitInfo):
    address: str = ""  # a gateway of the cluster (default: TENSORCAST_ADDRESS of the vLLM process)
    model: str = ""  # the publisher's model name: versions are {model}@v{N}
    timeout: float = 300.0  # seconds each update's reads may take
    verify: bool = True  # check every tensor read against its content digest


@dataclass
class TensorCastUpdateInfo(WeightTransferUpdateInfo):
    version: int = 0
    model: str = ""  # default: the init's


class TensorCastWeightTransferEngine(WeightTransferEngine):  # type: ignore[misc,valid-type]
    """One per vLLM worker (``WeightTransferEngineFactory.create_engine``)."""

    init_info_cls = TensorCastInitInfo
    update_info_cls = TensorCastUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self._init: TensorCastInitInfo | None = None
        self._client: Any = None
        self._staged: tuple[int, dict[str, Any]] | None = None
        self._loaded: Layout | None = None
        self.active_version: int | None = None
        self.last_update: dict[str, Any] = {}

    # ----------------------------------------------------------------- vLLM's hooks
    def init_transfer_engine(self, init_info: TensorCastInitInfo) -> None:
        import tensorcast as tc

        address = init_info.address or os.environ.get("TENSORCAST_ADDRESS", "")
        if not address or not init_info.model:
            raise InvalidArgument("the tensorcast weight transfer needs init_info {'address': GATEWAY (or "
                                  "TENSORCAST_ADDRESS), 'model': NAME}")
        if not init_info.timeout > 0:
            raise InvalidArgument(f"timeout must be > 0, got {clip(init_info.timeout)}")
        self.shutdown()
        self._client = tc.connect(address, config=tc.Config.from_flat({"client.timeout": init_info.timeout}))
        self._init = init_info

    def start_weight_update(self) -> None:
        self._staged = None  # the model is not touched until finish

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class would synchronize the accelerator: nothing runs on it until finish.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: TensorCastUpdateInfo) -> None:
        init = self._require_init()
        model = update_info.model or init.model
        if not isinstance(update_info.version, int) or isinstance(update_info.version, bool) or \
                update_info.version < 1:
            raise InvalidArgument(f"update_info needs a version >= 1, got {clip(update_info.version)}")
        self._staged = None
        t0 = time.perf_counter()
        tensors = self._read(model, update_info.version, init)
        check_compatible(self._loaded, layout_of(tensors))
        self._staged = (update_info.version, tensors)
        self.last_update = {"version": update_info.version, "tensors": len(tensors),
                            "bytes": sum(int(t.nbytes) for t in tensors.values()),
                            "staged_seconds": time.perf_counter() - t0}
        log.info("TensorCast: staged %s v%d (%d tensors) in %.2f s", model, update_info.version, len(tensors),
                 self.last_update["staged_seconds"])

    def finish_weight_update(self) -> None:
        if self._staged is None:
            raise InvalidArgument("finish_weight_update without a staged version (update_weights failed or was "
                                  "not called): the model is unchanged")
        version, tensors = self._staged
        self._staged = None
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        t0 = time.perf_counter()
        initialize_layerwise_reload(self.model)
        self.model.load_weights(iter(tensors.items()))
        finalize_layerwise_reload(self.model, self.model_config)
        self._loaded = self._loaded or layout_of(tensors)
        self.active_version = version
        self.last_update["load_seconds"] = time.perf_counter() - t0
        log.info("TensorCast: loaded v%d in %.2f s", version, self.last_update["load_seconds"])

    def shutdown(self) -> None:
        self._staged = None
        if self._client is not None:
            self._client.close()
            self._client = None

    # ----------------------------------------------------------------- reading a version
    def _require_init(self) -> TensorCastInitInfo:
        if self._init is None or self._client is None:
            raise InvalidArgument("init_weight_transfer_engine first")
        return self._init

    def _read(self, model: str, version: int, init: TensorCastInitInfo) -> dict[str, Any]:
        from tensorcast.weights.versions import VERSION_TENSOR, version_key

        art = self._client.artifact(version_key(model, version), timeout=init.timeout)
        tensors = art.tensor_dict(like="torch")
        tensors.pop(VERSION_TENSOR, None)  # the publisher's tag, not a weight
        if init.verify:
            check_digests(art.info, tensors, f"{model} v{version}")
        return dict(tensors)
