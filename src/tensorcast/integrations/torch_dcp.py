"""TensorCast as a storage backend of PyTorch Distributed Checkpoint (``torch.distributed.checkpoint``).

Owns: ``TensorCastWriter`` (a DCP ``StorageWriter`` and the ``AsyncStager`` that ``dcp.async_save`` uses)
and ``TensorCastReader`` (a ``StorageReader``), and the calls on a checkpoint as a whole: listing a run's
checkpoints, deleting one, collecting all but the last ``keep_last``, loading one into a plain full state
dict on one process, and publishing one as a weight version. A checkpoint is a bundle: one artifact per
saving rank (its shards, put into a worker on the rank's own host) and a manifest under the checkpoint's
key holding DCP's metadata, which names each chunk's artifact id and tensor. Saving puts memory replicas
first (the training stall ends there) and the disk copy in the background; loading reads through views, so
each rank receives only the byte ranges its new layout needs, cut by the holder. Does not own: DCP's
planning and resharding (its planners), the layout rules (``integrations.torch_dcp_layout``).
"""

from __future__ import annotations

import io
import pickle
import threading
import uuid
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from tensorcast.client.sync import Artifact, Client, connect
from tensorcast.errors import InvalidArgument
from tensorcast.integrations.torch_dcp_layout import (
    METADATA_TENSOR,
    CheckpointEntry,
    Stored,
    collectable,
    is_bundle_member,
    item_name,
    memory_first,
    rank_key,
    read_rounds,
    read_slices,
    reading_prefix,
    run_prefix,
    writer_worker,
)
from tensorcast.integrations.torch_dcp_staging import stage_copy, staged_buffers
from tensorcast.pool.placement import resolve_placement
from tensorcast.records import Placement

__all__ = ["TensorCastReader", "TensorCastWriter", "delete_checkpoint", "full_state_dict", "list_checkpoints",
           "publish_weights"]

# The default placement: two memory replicas on distinct workers and a disk copy (written in the background).
DEFAULT_POLICY = "ha"


def _client(client_or_address: Client | str, token: str | None) -> tuple[Client, bool]:
    if isinstance(client_or_address, Client):
        return client_or_address, False
    return connect(client_or_address, token), True


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class TensorCastWriter(StorageWriter):
    """Writes a DCP checkpoint under ``key`` (``dcp.save(sd, storage_writer=TensorCastWriter(addr, key))``).

    ``policy``: where the bytes end up (default ``ha``: two memory replicas and a disk copy; a placement with
    a disk copy is reached in two puts, memory first, so ``save`` returns before the disk write).
    ``keep_last``: after a save, the coordinator collects all but the newest N checkpoints of the run (the
    keys beside ``key`` up to its last ``/``), except those being read. ``pin_memory``: stage GPU tensors
    for ``async_save`` in pinned host memory, kept from one save to the next.
    """

    _synchronize_after_execute = False  # staging is a blocking copy (AsyncStager)

    def __init__(self, client_or_address: Client | str, key: str, *, policy: str | Placement | None = None,
                 token: str | None = None, keep_last: int | None = None, pin_memory: bool | None = None) -> None:
        super().__init__()
        if keep_last is not None and keep_last < 1:
            raise InvalidArgument(f"keep_last must be >= 1, got {keep_last}")
        self.key = key
        self.placement = resolve_placement(policy if policy is not None else DEFAULT_POLICY)
        self.keep_last = keep_last
        self._client, self._owns_client = _client(client_or_address, token)
        self._pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._staged: dict[str, Any] | None = None
        self._background: list[threading.Thread] = []
        self._errors: list[BaseException] = []
        self.is_coordinator = False

    # ------------------------------------------------------------------ StorageWriter
    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id:
            self.key = str(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # chosen only when passed explicitly

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.key)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        tensors: dict[str, Any] = {}
        sizes: dict[str, int] = {}
        for item in plan.items:
            name = item_name(item.index.fqn, item.index.offset if item.type == WriteItemType.SHARD else None)
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                tensors[name] = np.frombuffer(raw, np.uint8)
            else:
                assert isinstance(data, torch.Tensor)
                tensors[name] = data.detach().to("cpu").contiguous()
            sizes[name] = int(tensors[name].nbytes)
        future: Future[list[WriteResult]] = Future()
        if not tensors:
            future.set_result([])
            return future
        rank = _rank()
        on = writer_worker(self._client.list_workers(), self._client.aio.host_id, rank)
        staged = memory_first(self.placement)
        art = self._client.put(tensors, key=rank_key(self.key, rank), policy=staged or self.placement, on=on)
        if staged is not None:
            self._persist(art, rank, on)
        results = []
        for item in plan.items:
            name = item_name(item.index.fqn, item.index.offset if item.type == WriteItemType.SHARD else None)
            results.append(WriteResult(index=item.index, size_in_bytes=sizes[name],
                                       storage_data=Stored(art.id, name)))
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        # DCP leaves recording where each chunk went to the storage layer: the reader looks chunks up here.
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
        raw = pickle.dumps(metadata)
        self._client.put({METADATA_TENSOR: np.frombuffer(raw, np.uint8)}, key=self.key, policy=self.placement)
        if self.keep_last is not None:
            collect(self._client, run_prefix(self.key), self.keep_last, keep=self.key)

    # ------------------------------------------------------------------ AsyncStager (dcp.async_save)
    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A host copy of ``state_dict`` that training may not change: every tensor (a DTensor's local shard)
        copied; with CUDA into pinned buffers kept from one save to the next, copied without blocking
        (``synchronize_staging`` waits for them)."""
        cache = self._staged if self._pin else None
        staged: dict[str, Any] = stage_copy(state_dict, cache, self._pin)
        if self._pin:
            self._staged = staged_buffers(staged)
        return staged

    def synchronize_staging(self) -> None:
        if self._pin and torch.cuda.is_available():
            torch.cuda.synchronize()

    def close(self) -> None:
        self.wait_durable()
        self._staged = None
        if self._owns_client:
            self._client.close()
            self._owns_client = False

    # ------------------------------------------------------------------ the disk copy
    def _persist(self, art: Artifact, rank: int, on: str | None) -> None:
        """Put this rank's artifact again under the final placement, from the pool's own copy (training may
        change its tensors meanwhile): same content, same artifact, now with its disk copy."""
        def run() -> None:
            try:
                mapped = self._client.artifact(art.id).tensor_dict(like="numpy")
                self._client.put(mapped, key=rank_key(self.key, rank), policy=self.placement, on=on)
            except BaseException as e:  # reported by wait_durable
                self._errors.append(e)

        thread = threading.Thread(target=run, name="tensorcast-dcp-persist", daemon=True)
        thread.start()
        self._background.append(thread)

    def wait_durable(self, timeout: float | None = None) -> None:
        """Block until this writer's background disk copies are written; raises the first that failed."""
        for thread in self._background:
            thread.join(timeout)
        self._background = [t for t in self._background if t.is_alive()]
        if self._errors:
            error, self._errors = self._errors[0], []
            raise error


class TensorCastReader(StorageReader):
    """Reads a DCP checkpoint from ``key`` (``dcp.load(sd, storage_reader=TensorCastReader(addr, key))``),
    into any layout DCP plans; while it reads, a leased mark keeps ``keep_last`` from collecting it."""

    def __init__(self, client_or_address: Client | str, key: str, *, token: str | None = None,
                 read_lease: float | None = None) -> None:
        super().__init__()
        self.key = key
        self._client, self._owns_client = _client(client_or_address, token)
        self._lease = read_lease or self._client.aio.config.client.checkpoint_read_lease
        self._storage_data: dict[Any, Stored] = {}
        self._mark: Artifact | None = None
        self._artifacts: dict[str, Artifact] = {}
        self.is_coordinator = False

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id:
            self.key = str(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self._hold()
        raw = self._client.artifact(self.key).tensor(METADATA_TENSOR, like="numpy")
        metadata: Metadata = pickle.loads(np.asarray(raw).tobytes())  # written by TensorCastWriter: trusted
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self._storage_data = dict(metadata.storage_data or {})
        self._hold()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            by_artifact: dict[str, list[ReadItem]] = {}
            for req in plan.items:
                by_artifact.setdefault(self._storage_data[req.storage_index].artifact_id, []).append(req)
            for artifact_id, reqs in by_artifact.items():
                self._read_artifact(self._artifact(artifact_id), reqs, planner)
        finally:
            self._release()
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _artifact(self, artifact_id: str) -> Artifact:
        if artifact_id not in self._artifacts:
            self._artifacts[artifact_id] = self._client.artifact(artifact_id)
        return self._artifacts[artifact_id]

    def _read_artifact(self, art: Artifact, reqs: list[ReadItem], planner: LoadPlanner) -> None:
        names = [self._storage_data[r.storage_index].name for r in reqs]
        shapes = {t.name: t.shape for t in art.info.tensors}
        for group in read_rounds(names):
            slices = {names[i]: ([] if reqs[i].type == LoadItemType.BYTE_IO else
                                 read_slices(shapes[names[i]], reqs[i].storage_offsets, reqs[i].lengths))
                      for i in group}
            got = art.view(slices).tensor_dict(like="torch")
            for i in group:
                req, tensor = reqs[i], got[names[i]]
                if req.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(req, io.BytesIO(tensor.numpy().tobytes()))
                    continue
                target = planner.resolve_tensor(req).detach()
                if target.size() != tensor.size():
                    raise InvalidArgument(f"checkpoint {self.key}: chunk {names[i]} read as {tuple(tensor.size())}, "
                                          f"the plan wants {tuple(target.size())}")
                target.copy_(tensor)
                planner.commit_tensor(req, target)

    def _hold(self) -> None:
        """Mark the checkpoint as being read (a leased key beside it) so that ``keep_last`` leaves it."""
        if self._mark is None:
            mark = np.frombuffer(uuid.uuid4().bytes, np.uint8)
            self._mark = self._client.put(mark, key=f"{reading_prefix(self.key)}{mark.tobytes().hex()}",
                                          ttl=self._lease, policy="cache")

    def _release(self) -> None:
        if self._mark is not None:
            mark, self._mark = self._mark, None
            mark.release()

    def close(self) -> None:
        self._release()
        if self._owns_client:
            self._client.close()
            self._owns_client = False


def list_checkpoints(client: Client, run: str) -> list[CheckpointEntry]:
    """The checkpoints under prefix ``run`` (their manifests), oldest first, each saying if it is read now."""
    arts = client.ls(run)
    reading = {a.key for a in arts if a.key and "/.reading-" in a.key}
    entries = [CheckpointEntry(a.key, a.info.created_at,
                               any(r.startswith(reading_prefix(a.key)) for r in reading))
               for a in arts if a.key and not is_bundle_member(a.key) and METADATA_TENSOR in a.tensor_names]
    return sorted(entries, key=lambda e: e.created_at)


def delete_checkpoint(client: Client, key: str) -> None:
    """Delete a checkpoint as a whole: its manifest first (so nothing half-deleted loads), then its ranks."""
    client.delete(key)
    for art in client.ls(key + "/."):
        if art.key and is_bundle_member(art.key) and not art.key.startswith(reading_prefix(key)):
            client.delete(art.key)


def collect(client: Client, run: str, keep_last: int, *, keep: str = "") -> list[str]:
    """Delete all but the newest ``keep_last`` checkpoints under ``run`` (never one being read, nor
    ``keep``); returns the keys deleted."""
    gone = [k for k in collectable(list_checkpoints(client, run), keep_last) if k != keep]
    for key in gone:
        delete_checkpoint(client, key)
    return gone


def full_state_dict(client: Client, key: str) -> dict[str, Any]:
    """The whole checkpoint as a plain state dict on this process (every shard gathered, no process group)."""
    reader = TensorCastReader(client, key)
    planner = _EmptyStateDictLoadPlanner()  # type: ignore[no-untyped-call]
    try:
        with warnings.catch_warnings():  # DCP warns that it loads in one process: what this call is for
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            dcp_load({}, storage_reader=reader, planner=planner, no_dist=True)
    finally:
        reader.close()
    # The planner rebuilt the nested state dict from the metadata and filled it (dcp.load fills a copy of
    # the dict it is given).
    return dict(planner.original_state_dict)


def publish_weights(client: Client, key: str, model: str, *, prefix: str = "",
                    select: Callable[[str, Any], bool] | None = None, version: int | None = None) -> int:
    """Publish a checkpoint's model weights as a version of ``model`` (``client.publisher``), for bindings,
    the transformers integration and the vLLM loader. ``prefix``: the state dict's branch holding the model
    (``"model."`` for ``{"model": ..., "optim": ...}``), stripped from the names."""
    state = _flatten(full_state_dict(client, key))
    weights = {name[len(prefix):]: t for name, t in state.items()
               if name.startswith(prefix) and isinstance(t, torch.Tensor) and (select is None or select(name, t))}
    if not weights:
        raise InvalidArgument(f"checkpoint {key} has no tensors under {prefix!r}")
    return client.publisher(model).publish(weights, version).version


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = value
    return out
