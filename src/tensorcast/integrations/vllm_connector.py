"""``TensorCastConnector``: vLLM's KV cache shared through TensorCast (a ``KVConnectorBase_V1``).

Turned on with ``kv_transfer_config={"kv_connector": "TensorCastConnector", "kv_role": "kv_both",
"kv_connector_extra_config": {"address": "HOST:PORT"}}`` (the name is registered by this package's
``vllm.general_plugins`` entry point, so it works with vLLM's engine multiprocessing). Extra config:
``address`` (default ``TENSORCAST_ADDRESS``), ``token``, ``model_id`` (what pages are salted with;
default: the served model), ``handoff_timeout`` (seconds a consumer waits for a producer's pages, 10),
``max_pending_save_bytes`` (saves in flight before a step waits for them, 256 MiB), ``page_keys``
(``"tokens"``, default: TensorCast's chained token hashes; ``"block-hash"``: vLLM's own block hashes, in the
namespace ``integrations.vllm_block_keys`` gives these pages, so that ``TensorCastTier`` finds them and the
pool's KV events carry the hashes vLLM's own events do), ``advertise_url`` (default
``TENSORCAST_ADVERTISE_URL``): this server's OpenAI URL (``http://host:port``), announced in ``list_instances()``
while the engine runs (``instance.announce``) so that ``tensorcast router --discover`` finds it; ``instance_id``
(default ``vllm@URL``).

KV events: with vLLM's ``kv_events_config``, ``take_events`` reports a ``BlockStored`` (medium ``CPU``,
ownership ``tensorcast``) for the pages each step saves, named as the pool's events name them; whether a
save landed, and when a page goes, the shard homes' own events say (``kv.events``).

Roles: ``kv_both`` loads and saves; ``kv_producer`` (a prefill instance) only saves and answers each
finished request with ``kv_transfer_params={"tensorcast_pages": N}``; ``kv_consumer`` (a decode instance)
only loads, and given those params waits for the N pages. Scheduler side: ``kv.exists`` on the prompt's
page keys (``vllm_kv_state`` decides). Worker side: a step's loads are read into vLLM's blocks before the
forward pass (``get_blocks``; a page that vanished in between is reported as a load error, and vLLM
recomputes from there); saves are gathered out of the blocks after it (one copy, the only time the step
waits) and put in the background. With tensor parallelism every rank stores its own heads under its own
keys (``KEY/rRANK``) and the scheduler asks about rank 0's.

Device caches (CUDA) go through ``DeviceBlocks``: a gather or scatter on the device with index tensors,
and one copy between the device and host staging. It is written for CUDA and guarded by the tensors'
device; its logic runs on CPU tensors in the tests. Host caches go through ``kv.blocks.BlockRegions``.

Does not own: what to load or save (``vllm_kv_state``), where pages live (``client.kv``).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.kv_cache_interface import AttentionSpec

from tensorcast.client.operation import Operation
from tensorcast.errors import InvalidArgument, TensorCastError
from tensorcast.integrations.vllm_block_keys import BlockHashChain, page_namespace
from tensorcast.integrations.vllm_kv_state import ConnectorState, KeyChain, StepTransfers, Transfer
from tensorcast.kv.blocks import BlockRegions
from tensorcast.kv.keys import KVLayout
from tensorcast.kv_events import MEDIUM, OWNERSHIP, block_hash_of
from tensorcast.tensors import dtype_name

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["DeviceBlocks", "TensorCastConnector", "TensorCastConnectorMetadata", "layout_of"]

log = logging.getLogger("vllm.tensorcast")


@dataclass
class TensorCastConnectorMetadata(KVConnectorMetadata):
    transfers: StepTransfers


def layout_of(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, model_id: str) -> KVLayout:
    """The layout of one page (one block of every layer) of this engine, from its KV cache config."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise InvalidArgument(f"TensorCastConnector supports models with one KV cache group; this one has "
                              f"{len(groups)} (hybrid attention)")
    spec = groups[0].kv_cache_spec
    if not isinstance(spec, AttentionSpec):
        raise InvalidArgument(f"TensorCastConnector needs attention KV caches, not {type(spec).__name__}")
    tp = vllm_config.parallel_config.tensor_parallel_size
    # MLA (DeepSeek-style): one latent per token and layer, the same on every tensor-parallel rank.
    mla = type(spec).__name__ == "MLAAttentionSpec"
    return KVLayout(model_id=f"{model_id}|vllm|tp{tp}", layers=len(groups[0].layer_names),
                    kv_heads=1 if mla else spec.num_kv_heads, head_dim=spec.head_size,
                    dtype=dtype_name(spec.dtype), page_size=spec.block_size, kind="mla" if mla else "mha")


class DeviceBlocks:
    """Blocks of device-resident per-layer caches, moved through host staging: a gather (or scatter) per
    region on the device with one index tensor, and one device<->host copy of the whole batch. Pinned
    staging and an asynchronous copy where the caches are on CUDA; plain tensors elsewhere (tests)."""

    def __init__(self, regions: list[torch.Tensor]) -> None:
        self.regions = regions
        self.device = regions[0].device
        widths = [r[0].numel() * r.element_size() for r in regions]
        self.offsets = np.cumsum([0, *widths]).tolist()
        self.page_bytes = int(self.offsets[-1])
        self.num_blocks = regions[0].shape[0]

    def gather(self, block_ids: list[int]) -> np.ndarray[Any, Any]:
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        rows = torch.cat([r.index_select(0, ids).reshape(len(block_ids), -1).view(torch.uint8)
                          for r in self.regions], dim=1)
        host = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        host.copy_(rows)  # synchronous: the blocks may be reused once this step ends
        return host.numpy()

    def scatter(self, block_ids: list[int], pages: np.ndarray[Any, Any]) -> None:
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        staged = torch.from_numpy(pages)
        if self.device.type == "cuda":
            staged = staged.pin_memory()
        rows = staged.to(self.device, non_blocking=True)
        for r, a, b in zip(self.regions, self.offsets, self.offsets[1:], strict=False):
            part = rows[:, a:b].contiguous().view(r.dtype).reshape(len(block_ids), *r.shape[1:])
            r.index_copy_(0, ids, part)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the forward pass reads them next


def _regions(kv_caches: dict[str, torch.Tensor], layer_names: list[str], num_blocks: int) -> list[torch.Tensor]:
    """Per layer (in the KV cache group's order), the tensors whose first axis is the block: K and V
    separately when a layer's cache is ``[2, num_blocks, ...]``."""
    out: list[torch.Tensor] = []
    for name in layer_names:
        t = kv_caches[name]
        if t.shape[0] == num_blocks:
            out.append(t)
        elif t.dim() > 1 and t.shape[0] == 2 and t.shape[1] == num_blocks:
            out += [t[0], t[1]]
        else:
            raise InvalidArgument(f"layer {name}: KV cache of shape {tuple(t.shape)} has no block axis of "
                                  f"{num_blocks}")
    return out


class TensorCastConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        extra = dict(ktc.kv_connector_extra_config or {})
        self._address = str(extra.get("address") or os.environ.get("TENSORCAST_ADDRESS") or "")
        if not self._address:
            raise InvalidArgument("TensorCastConnector needs kv_connector_extra_config['address'] or "
                                  "TENSORCAST_ADDRESS")
        self._token = extra.get("token")
        model_id = str(extra.get("model_id") or vllm_config.model_config.served_model_name
                       or vllm_config.model_config.model)
        self.layout = layout_of(vllm_config, kv_cache_config, model_id)
        self._num_blocks = kv_cache_config.num_blocks
        self._layer_names = list(kv_cache_config.kv_cache_groups[0].layer_names)
        tp = vllm_config.parallel_config
        self._rank, self._world = tp.rank % tp.tensor_parallel_size, tp.tensor_parallel_size
        self._client: Any = None
        self._requests: dict[str, Request] = {}
        self.page_keys = str(extra.get("page_keys", "tokens"))
        chain = None
        if self.page_keys == "block-hash":
            if not vllm_config.cache_config.enable_prefix_caching:
                raise InvalidArgument("page_keys='block-hash' names pages by vLLM's block hashes, which vLLM "
                                      "computes with prefix caching only: enable it")
            ns = page_namespace(str(extra.get("model_id") or vllm_config.model_config.model), self.layout.dtype,
                                self.layout.page_size, self.layout.layers, self.layout.page_bytes).id
            chain = self._block_hash_chain(ns)
        elif self.page_keys != "tokens":
            raise InvalidArgument(f"page_keys must be 'tokens' or 'block-hash', not {self.page_keys!r}")
        self._state = ConnectorState(self.layout, load=bool(ktc.is_kv_consumer), save=bool(ktc.is_kv_producer),
                                     handoff_timeout=float(extra.get("handoff_timeout", 10.0)), chain=chain)
        events = vllm_config.kv_events_config
        self._events: list[Any] | None = [] if events is not None and events.enable_kv_cache_events else None
        # Worker side.
        self._blocks: BlockRegions | DeviceBlocks | None = None
        self._pending: deque[tuple[Operation[int], int]] = deque()
        self._pending_bytes = 0
        self._max_pending = int(extra.get("max_pending_save_bytes", 256 << 20))
        self._load_errors: set[int] = set()
        self.stats = {"pages_loaded": 0, "pages_missed": 0, "pages_saved": 0, "saves_failed": 0}
        log.info("TensorCast KV connector (%s, %s): pages of %d tokens, %d bytes", role.name, ktc.kv_role,
                 self.layout.page_size, self.layout.page_bytes)
        if ktc.kv_load_failure_policy != "recompute":
            log.warning("TensorCast: a page evicted between lookup and load fails its request under "
                        "kv_load_failure_policy=%r; set 'recompute' to have vLLM recompute it instead",
                        ktc.kv_load_failure_policy)
        self.client()  # connect now: a wrong address fails the engine's start, not its first request
        url = str(extra.get("advertise_url") or os.environ.get("TENSORCAST_ADVERTISE_URL") or "")
        self._announcing = None
        if url and role == KVConnectorRole.SCHEDULER:  # one per engine, not one per rank
            from tensorcast.instance.announce import Announcement

            self._announcing = Announcement(self._address, url, engine="vllm", token=self._token,
                                            instance_id=str(extra.get("instance_id") or ""))

    def _block_hash_chain(self, namespace_id: str) -> Any:
        """Each request's keys from its ``block_hashes`` (one per block: a single KV-cache group, whose hash
        block size is its block size)."""
        def chain(req_id: str) -> KeyChain:
            request = self._requests.get(req_id)
            return BlockHashChain(namespace_id, lambda: request.block_hashes if request is not None else [],
                                  self.layout.page_size)
        return chain

    # ----------------------------------------------------------------- shared
    def client(self) -> Any:
        if self._client is None:
            import tensorcast as tc

            self._client = tc.connect(self._address, token=self._token)
            max_page = self._client.aio.config.kv.max_page_bytes
            if self.layout.page_bytes > max_page:
                raise InvalidArgument(f"a vLLM block of every layer is {self.layout.page_bytes} bytes, over "
                                      f"kv.max_page_bytes ({max_page}): raise it or use a smaller block size")
        return self._client

    def _keys(self, keys: list[str], rank: int | None = None) -> list[str]:
        rank = self._rank if rank is None else rank
        return keys if self._world == 1 else [f"{k}/r{rank}" for k in keys]

    # ----------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._requests[request.request_id] = request
        try:
            keys = self._state.probe(request.request_id, request.prompt_token_ids or [], num_computed_tokens,
                                     request.kv_transfer_params)
            if not keys:
                return 0, False
            present = self.client().kv.exists(self._keys(keys, rank=0))
        except TensorCastError as exc:  # recomputing is always correct
            log.warning("TensorCast: prefix lookup failed, computing the prompt: %s", exc)
            return 0, False
        return self._state.matched(request.request_id, present, time.monotonic()), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._state.allocated(request.request_id, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        manager = self._kv_cache_manager
        scheduled: list[tuple[str, Any, Any, int]] = []
        n_tokens = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            request = self._requests.get(new.req_id)
            tokens = request.all_token_ids if request is not None else new.prompt_token_ids or []
            scheduled.append((new.req_id, tokens, new.block_ids[0], new.num_computed_tokens + n_tokens[new.req_id]))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            request = self._requests.get(req_id)
            if request is None or manager is None:
                continue
            scheduled.append((req_id, request.all_token_ids, manager.get_block_ids(req_id)[0],
                              cached.num_computed_tokens[i] + n_tokens[req_id]))
        transfers = self._state.step(scheduled)
        if self._events is not None:
            self._announce(transfers.saves)
        return TensorCastConnectorMetadata(transfers)

    def _announce(self, saves: list[Transfer]) -> None:
        """A ``BlockStored`` per save, with its tokens and its parent's hash, so that a router can chain it."""
        from vllm.distributed.kv_events import BlockStored

        size = self.layout.page_size
        for save in saves:
            request = self._requests.get(save.req_id)
            tokens = list(request.all_token_ids[save.first_page * size:(save.first_page + len(save.keys)) * size]) \
                if request is not None else []
            parent = self._state.parent_key(save)
            hashes: list[Any] = [block_hash_of(k)[0] for k in save.keys]
            assert self._events is not None
            self._events.append(BlockStored(
                block_hashes=hashes, parent_block_hash=block_hash_of(parent)[0] if parent else None,
                token_ids=tokens if len(tokens) == size * len(hashes) else [], block_size=size, lora_id=None,
                medium=MEDIUM, lora_name=None, ownership=OWNERSHIP))

    def take_events(self) -> Any:
        """``BlockStored`` for the pages the steps since the last call saved (vLLM publishes them)."""
        events, self._events = self._events, ([] if self._events is not None else None)
        return events or ()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        return False, self._state.finished(request.request_id)

    # ----------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        regions = _regions(kv_caches, self._layer_names, self._num_blocks)
        if all(r.device.type == "cpu" and r[0].is_contiguous() for r in regions):
            self._blocks = BlockRegions(regions)
        else:
            self._blocks = DeviceBlocks(regions)
        if self._blocks.page_bytes != self.layout.page_bytes:
            raise InvalidArgument(f"vLLM's blocks hold {self._blocks.page_bytes} bytes of every layer; the "
                                  f"layout says {self.layout.page_bytes}")

    def _metadata(self) -> StepTransfers:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TensorCastConnectorMetadata)
        return meta.transfers

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        for load in self._metadata().loads:
            self._load(load)

    def _load(self, load: Transfer) -> None:
        assert self._blocks is not None
        keys = self._keys(load.keys)
        try:
            if isinstance(self._blocks, BlockRegions):
                hits = self.client().kv.get_blocks(keys, load.block_ids, self._blocks)
            else:
                pages = np.empty((len(keys), self._blocks.page_bytes), np.uint8)
                hits = self.client().kv.get_into(keys, list(pages))
                n = hits.index(False) if False in hits else len(hits)
                if n:
                    self._blocks.scatter(load.block_ids[:n], pages[:n])
        except TensorCastError as exc:
            log.warning("TensorCast: loading %d pages failed, vLLM recomputes them: %s", len(keys), exc)
            hits = [False] * len(keys)
        n = hits.index(False) if False in hits else len(hits)  # a prefix: everything after a gap is recomputed
        self._load_errors.update(load.block_ids[n:])
        self.stats["pages_loaded"] += n
        self.stats["pages_missed"] += len(keys) - n

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # every load finished in start_load_kv, before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # blocks are saved whole (every layer) in wait_for_save

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        assert self._blocks is not None
        for save in self._metadata().saves:
            ids = np.asarray(save.block_ids, dtype=np.int64)
            pages = self._blocks.gather(ids) if isinstance(self._blocks, BlockRegions) \
                else self._blocks.gather(save.block_ids)
            operation = self.client().ops.kv_put(self._keys(save.keys), list(pages))
            self._pending.append((operation, pages.nbytes))
            self._pending_bytes += pages.nbytes
        self._reap(block=False)

    def _reap(self, block: bool) -> None:
        """Collect finished saves; wait for the oldest while more than ``max_pending_save_bytes`` are in
        flight (or all of them, with ``block``)."""
        while self._pending and (self._pending[0][0].done() or block or self._pending_bytes > self._max_pending):
            operation, nbytes = self._pending.popleft()
            self._pending_bytes -= nbytes
            try:
                self.stats["pages_saved"] += operation.result()
            except TensorCastError as exc:  # a lost save is a future miss, never wrong data
                self.stats["saves_failed"] += 1
                log.warning("TensorCast: saving KV pages failed: %s", exc)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._announcing is not None:
            self._announcing.stop()  # the record turns not alive: routers stop finding it
        self._reap(block=True)
        if self._client is not None:
            log.info("TensorCast KV connector stats: %s", self.stats)
            self._client.close()
            self._client = None
