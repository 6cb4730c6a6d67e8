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
  A **delta**: when the engine serves the version N carries a delta record from (``weights.delta``: the
  publisher published N right after it), less is read. Where the model's parameters keep their loaders
  (unquantized, not repacked: vLLM's GPU builds), only the changed chunks (runs of rows), each checked against
  its checksum; elsewhere (vLLM's CPU build repacks every linear layer, quantized models) the whole tensors of
  the layers the delta touches (``rollout_delta.touched_layers``), checked against their digests.
  ``last_update`` says which (``mode``: full, rows or layers; ``read_bytes``).
- finish: the staged version goes through vLLM's layerwise reload (the path its own engines take: vLLM shards,
  fuses and repacks each tensor for this rank, parameters keep their addresses) within this one call, between
  two steps of the engine: no step sees a mix; a layers delta reloads those layers only (the others keep their
  tensors). A rows delta is written in place through vLLM's checkpoint patches
  (``load_checkpoint_weight_patches``: the model's own loaders map checkpoint rows to this rank's parameters,
  packed ones included); should vLLM refuse the patch, the whole version is loaded instead, and later deltas
  reload layers. The trainer pauses the engine around it (``/pause``, in-flight requests drained, the
  prefix cache cleared: cached KV came from the old weights) and resumes it after. The engine knows the
  version it loaded itself: weights loaded by another route meanwhile (``reload_weights``) must be the same.

A failed update (no such version, a digest mismatch, a deadline: ``update`` raises) leaves the old weights
serving untouched; ``finish`` without a staged version raises before touching the model. Every read has the
init's ``timeout`` as its deadline: nothing waits on a peer forever. Staged versions must keep the names,
dtypes and shapes of the first one loaded (``rollout_checks.check_compatible``), so a wrong model is refused before the
reload. Does not own: publishing (``client.publisher``, ``integrations.vllm_transfer_trainer``), vLLM's reload.

GPU: tensors are handed to vLLM on the host (mapped pool pages); vLLM's loaders copy them to the device; a
delta's rows are copied to the device first, where its patches are built (not tested without a GPU here).
"""

from __future__ import annotations

import logging
import math
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
from tensorcast.integrations.rollout_checks import Layout, check_compatible, check_digests, layout_of_info
from tensorcast.integrations.rollout_delta import ChangedRows, delta_of, read_changed, touched_layers
from tensorcast.weights.versions import META_TENSORS, version_key

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


@dataclass
class _Staged:
    version: int
    model: str
    art: Any  # the version's Artifact handle
    mode: str = "full"  # full, layers (the tensors of the layers a delta touches) or rows
    tensors: dict[str, Any] | None = None  # full and layers, or
    rows: list[ChangedRows] | None = None  # the rows that changed since the version served


class TensorCastWeightTransferEngine(WeightTransferEngine):  # type: ignore[misc,valid-type]
    """One per vLLM worker (``WeightTransferEngineFactory.create_engine``)."""

    init_info_cls = TensorCastInitInfo
    update_info_cls = TensorCastUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self._init: TensorCastInitInfo | None = None
        self._client: Any = None
        self._staged: _Staged | None = None
        self._loaded: Layout | None = None
        self._patches_work = True  # until a loader refuses vLLM's checkpoint patches
        self.active_version: int | None = None
        self._active_model = ""
        self._active_info: Any = None  # the served version's record: a delta's consistency is checked against it
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
        # Another cluster, or this one wiped, may number other weights alike: the next update is a whole one.
        self.active_version, self._active_info = None, None
        self._client = tc.connect(address, config=tc.Config.from_flat({"client.timeout": init_info.timeout}))
        self._init = init_info

    def start_weight_update(self) -> None:
        self._staged = None  # the model is not touched until finish

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class would synchronize the accelerator: nothing runs on it until finish.
        error: Exception | None = None
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except Exception as exc:  # every rank learns of every failure below, then one raises
            error = exc
        self._agree(error)

    def _agree(self, error: Exception | None) -> None:
        """All ranks of this engine stage the update or none does, and one error answers for them. vLLM's
        multiprocess executor reads the ranks' answers in rank order and stops at the first failure, leaving
        the others' answers to be taken for the next call's (vLLM 0.32): so the ranks exchange their outcome,
        every one drops its staged version if any failed, and only the last rank raises."""
        group, rank, size = _engine_ranks()
        if size == 1:
            if error is not None:
                raise error
            return
        import torch.distributed as dist

        outcomes: list[Any] = [None] * size
        dist.all_gather_object(outcomes, None if error is None else f"{type(error).__name__}: {error}", group=group)
        failed = [(r, o) for r, o in enumerate(outcomes) if o is not None]
        if not failed:
            return
        self._staged = None
        if rank == size - 1:
            if error is not None:
                raise error
            r, outcome = failed[0]
            raise InvalidArgument(f"rank {r} of this engine could not stage the update (the model is unchanged): "
                                  f"{clip(outcome)}")

    def receive_weights(self, update_info: TensorCastUpdateInfo) -> None:
        init = self._require_init()
        model = update_info.model or init.model
        if not isinstance(update_info.version, int) or isinstance(update_info.version, bool) or \
                update_info.version < 1:
            raise InvalidArgument(f"update_info needs a version >= 1, got {clip(update_info.version)}")
        self._staged = None
        t0 = time.perf_counter()
        art = self._client.artifact(version_key(model, update_info.version), timeout=init.timeout)
        check_compatible(self._loaded, layout_of_info(art.info))  # a wrong model is refused before any read
        staged = _Staged(update_info.version, model, art)
        active = self.active_version if self._active_model == model else None
        delta = delta_of(art, active, self._active_info)
        read = 0
        if delta is not None and self._patchable():
            rows, read = read_changed(art, delta, init.verify)
            # NaN is the patches' "unchanged" mark, and integers have no NaN: such updates take a reload.
            if all(_patchable_rows(r.rows) for r in rows):
                staged.mode, staged.rows = "rows", rows
        if delta is not None and staged.rows is None:
            weights = [t.name for t in art.info.tensors if t.name not in META_TENSORS]
            staged.mode = "layers"
            staged.tensors = self._read(art, touched_layers(delta.tensors, weights), init.verify)
        if staged.mode == "full":
            staged.tensors = self._read(art, None, init.verify)
        if staged.tensors is not None:
            read += sum(int(t.nbytes) for t in staged.tensors.values())
        self._staged = staged
        self.last_update = {"version": update_info.version, "mode": staged.mode,
                            "bytes": sum(t.nbytes for t in art.info.tensors if t.name not in META_TENSORS),
                            "read_bytes": read, "staged_seconds": time.perf_counter() - t0}
        log.info("TensorCast: staged %s v%d (%s, %d bytes read) in %.2f s", model, update_info.version,
                 self.last_update["mode"], read, self.last_update["staged_seconds"])

    def finish_weight_update(self) -> None:
        if self._staged is None:
            raise InvalidArgument("finish_weight_update without a staged version (update_weights failed or was "
                                  "not called): the model is unchanged")
        staged, self._staged = self._staged, None
        t0 = time.perf_counter()
        # Until this load completes: one that fails midway leaves a mix, and the next update must then be a
        # whole version, not a delta from the one served before.
        self.active_version, self._active_info = None, None
        if staged.rows:
            try:
                self._patch(staged.rows)
            except (NotImplementedError, ValueError, TypeError, AttributeError, ImportError, RuntimeError) as exc:
                # Some parameters may be patched already: the whole version overwrites every one of them.
                log.warning("TensorCast: vLLM's checkpoint patches refused (%s); loading the whole version now, "
                            "and reloading layers on later deltas", exc)
                self._patches_work = False
                self.last_update["mode"] = "full"
                self._reload(self._read(staged.art, None, self._require_init().verify))
        elif staged.tensors:  # a delta that changed nothing (the same weights again) leaves the model as it is
            # (no rows, or no layer touched)
            self._reload(staged.tensors, partial=staged.mode == "layers")
        self._loaded = self._loaded or layout_of_info(staged.art.info)
        self.active_version, self._active_model, self._active_info = staged.version, staged.model, staged.art.info
        self.last_update["load_seconds"] = time.perf_counter() - t0
        log.info("TensorCast: loaded v%d (%s) in %.2f s", staged.version, self.last_update["mode"],
                 self.last_update["load_seconds"])

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

    def _read(self, art: Any, names: list[str] | None, verify: bool) -> dict[str, Any]:
        """The version's weights (``names`` of them), checked against their digests."""
        if names is None:
            tensors = dict(art.tensor_dict(like="torch"))
            for name in META_TENSORS:
                tensors.pop(name, None)  # the publisher's tag and delta record, not weights
        else:
            tensors = dict(art.view({n: [] for n in names}).tensor_dict(like="torch")) if names else {}
        if verify:
            check_digests(art.info, tensors, art.id)
        return tensors

    # ----------------------------------------------------------------- loading it
    def _patchable(self) -> bool:
        """Whether vLLM's checkpoint patches can write into the parameters: unquantized, every parameter still
        has its loader (vLLM's CPU build repacks linear layers into parameters without one)."""
        return self._patches_work and getattr(self.model_config, "quantization", None) is None and \
            all(hasattr(p, "weight_loader") for p in self.model.parameters())

    def _reload(self, tensors: dict[str, Any], partial: bool = False) -> None:
        """vLLM's layerwise reload of ``tensors``; ``partial``: of some layers, the others keep theirs (vLLM
        warns once per such layer: quieted, it is the point)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        level = layerwise.level
        if partial:
            layerwise.setLevel(logging.ERROR)
        try:
            initialize_layerwise_reload(self.model)
            self.model.load_weights(iter(tensors.items()))
            finalize_layerwise_reload(self.model, self.model_config)
        finally:
            layerwise.setLevel(level)

    def _patch(self, rows: list[ChangedRows]) -> None:
        """The changed rows written in place through vLLM's sparse checkpoint patches (one per tensor)."""
        import torch
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (
            CheckpointWeightPatch,
            load_checkpoint_weight_patches,
        )

        by_name: dict[str, list[ChangedRows]] = {}
        for r in rows:
            by_name.setdefault(r.name, []).append(r)
        patches = []
        for name, parts in by_name.items():
            shape = parts[0].shape
            per_row = math.prod(shape[1:])
            index = torch.cat([torch.arange(p.first_row * per_row, p.first_row * per_row + p.rows.numel())
                               for p in parts])
            values = torch.cat([p.rows.reshape(-1) for p in parts]).to(self.device)
            patches.append(CheckpointWeightPatch(name=name, shape=shape, dtype=values.dtype, values=values,
                                                 indices=index.to(self.device)))
        load_checkpoint_weight_patches(self.model, patches, validate_unique_indices=False)


def _engine_ranks() -> tuple[Any, int, int]:
    """This engine's tensor-parallel ranks (the workers its executor answers for, without pipeline stages):
    (their CPU process group, this rank, how many). One rank where vLLM's groups are not set up, and with
    pipeline parallelism (not covered: there the first failure answers, as in vLLM)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        if get_pp_group().world_size != 1:
            return None, 0, 1
        group = get_tp_group()
        return group.cpu_group, group.rank_in_group, group.world_size
    except (ImportError, AssertionError, AttributeError):
        return None, 0, 1


def _patchable_rows(t: Any) -> bool:
    import torch

    return bool(t.is_floating_point()) and not bool(torch.isnan(t).any())
