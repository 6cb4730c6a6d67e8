"""``TensorCastTier``: the pool as a secondary tier of vLLM's OffloadingConnector (``TieringOffloadingSpec``).

Configuration only, no registration: ``--kv-transfer-config '{"kv_connector": "OffloadingConnector",
"kv_role": "kv_both", "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use":
N, "secondary_tiers": [{"type": "TensorCastTier", "module_path": "tensorcast.integrations.vllm_tier",
"address": "HOST:PORT"}]}}'``. Tier options: ``address`` (default ``TENSORCAST_ADDRESS``), ``token``,
``model_id`` (what keys are salted with; default: the model vLLM was given), ``ttl`` (seconds pages are kept;
default ``kv.page_ttl``), ``threads`` (transfers in flight, 4), ``max_page_bytes`` (the parts a unit is cut
into: at most the shard homes' ``kv.max_page_bytes``; default this process's), ``page_format`` (``"vllm"``,
default: units as vLLM's offloading worker lays them out; ``"tensorcast"``: declares them the pages of
``TensorCastConnector`` — vLLM's canonical layout of a split-KV HND backend, one rank, one block per unit —
so that the tier and the connector with ``page_keys="block-hash"`` find each other's pages),
``enable_kv_events`` (report stored units through vLLM's KV events; needs ``kv_events_config``), ``locality``
(``"REMOTE"``, default, or ``"LOCAL"``).

vLLM keeps its CPU tier (the primary: every GPU<->tier copy goes through it); this tier stores each unit the
primary holds into the pool (asynchronously: ``submit_store`` only queues) and promotes units other instances
stored into it (``submit_load``). Units are named by vLLM's block hashes (``integrations.vllm_block_keys``),
so every instance of the same model and KV layout finds every other's units, and ``TensorCastConnector``
with ``page_keys="block-hash"`` stores and finds the same pages. Lookups never block the scheduler: the first
answer is "retry" while one batched lookup per step runs on vLLM's lookup thread. A unit that vanished between
lookup and load is reported as not loaded (vLLM recomputes it), never as loaded. Scheduler process only: the
tier touches no GPU memory. Does not own: the transfers themselves (``integrations.vllm_tier_io``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    get_offload_block_hash,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob

from tensorcast.errors import InvalidArgument
from tensorcast.integrations.vllm_block_keys import BlockNamespace, block_key, page_namespace
from tensorcast.integrations.vllm_tier_io import TierIO
from tensorcast.kv_events import OWNERSHIP

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = ["TensorCastTier", "namespace_of"]

log = logging.getLogger("vllm.tensorcast")


def namespace_of(offloading_spec: OffloadingSpec, model_id: str | None = None,
                 page_format: str = "vllm") -> tuple[BlockNamespace, int]:
    """The block namespace of this engine's offloaded units, and a unit's bytes (unpadded: all ranks' blocks
    of every layer)."""
    cfg = offloading_spec.config
    copies = 1 if offloading_spec.replicated_layout else cfg.parallel.world_size
    unit = cfg.worker_kv_bytes_per_block * copies * cfg.cache.blocks_per_chunk
    if page_format == "tensorcast":
        layout = (cfg.kv_cache_layout or "").upper()
        if not cfg.canonical_layout or layout not in ("LBHNC", "BLHNC", "BHLNC") or copies != 1 \
                or cfg.cache.blocks_per_chunk != 1 or len(cfg.groups) != 1:
            raise InvalidArgument("page_format='tensorcast' needs vLLM's canonical_layout over an HND KV cache "
                                  "layout, one rank and one block per unit (a single KV-cache group): those units "
                                  f"are TensorCastConnector's pages; got canonical_layout={cfg.canonical_layout}, "
                                  f"layout {cfg.kv_cache_layout}, {copies} ranks, {cfg.cache.blocks_per_chunk} "
                                  f"blocks per unit, {len(cfg.groups)} groups")
        group = cfg.groups[0]
        return page_namespace(model_id or cfg.model.name, cfg.model.dtype, group.tokens_per_block,
                              len(group.layer_names), unit), unit
    if page_format != "vllm":
        raise InvalidArgument(f"page_format must be 'vllm' or 'tensorcast', not {page_format!r}")
    fmt = ""
    if cfg.canonical_layout and cfg.kv_cache_layout is not None:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import canonical_format_id

        fmt = canonical_format_id(cfg.kv_cache_layout)
    ns = BlockNamespace(model=model_id or cfg.model.name, dtype=cfg.model.dtype,
                        groups=tuple((g.tokens_per_block, len(g.layer_names)) for g in cfg.groups),
                        unit_bytes=unit, blocks_per_unit=cfg.cache.blocks_per_chunk,
                        tp=cfg.parallel.tp_size, pp=cfg.parallel.pp_size, canonical_format=fmt)
    return ns, unit


class _Lookups(AsyncLookupManager):
    def __init__(self, tier: TensorCastTier, tier_type: str) -> None:
        super().__init__(tier_type=tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        try:
            return self._tier.io.present(self._tier.keys(keys))
        except Exception as exc:  # an unreachable pool is a miss: vLLM computes the blocks
            log.warning("TensorCast tier: lookup failed, reporting misses: %s", exc)
            return [False] * len(keys)


class TensorCastTier(SecondaryTierManager):
    medium: ClassVar[Medium] = Medium.CPU  # the pool keeps units in memory (of this host or another)

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview, tier_type: str, *,
                 address: str = "", token: str | None = None, model_id: str | None = None,
                 ttl: float | None = None, threads: int = 4, max_page_bytes: int | None = None,
                 page_format: str = "vllm", enable_kv_events: bool = False,
                 locality: str | None = "REMOTE", backpressure_detector: BackpressureDetector | None = None,
                 client: Any = None) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality else None
        namespace, unit = namespace_of(offloading_spec, model_id, page_format)
        self.namespace = namespace.id
        owns_client = client is None
        if client is None:
            import tensorcast as tc

            address = address or os.environ.get("TENSORCAST_ADDRESS", "")
            if not address:
                raise InvalidArgument("TensorCastTier needs 'address' in its tier config or TENSORCAST_ADDRESS")
            client = tc.connect(address, token=token)
        flat = np.asarray(primary_kv_view).view(np.uint8).reshape(-1)
        rows = flat.reshape(len(primary_kv_view), -1) if len(primary_kv_view) else flat.reshape(0, max(unit, 1))
        self.io = TierIO(client, rows, unit, ttl=ttl, threads=threads, max_page_bytes=max_page_bytes)
        self._owns_client = owns_client
        self._keys: dict[JobId, list[OffloadKey]] = {}
        self._stores: set[JobId] = set()
        self.events: list[OffloadingEvent] | None = None
        if enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self.events = []
            else:
                log.warning("TensorCast tier: enable_kv_events is set but vLLM's KV events are off")
        self._lookups = _Lookups(self, tier_type)
        log.info("TensorCast tier: units of %d bytes, namespace %s, %d parts per unit", unit, self.namespace,
                 len(self.io.parts("x")))

    def keys(self, keys: Iterable[OffloadKey]) -> list[str]:
        ns = self.namespace
        return [block_key(ns, get_offload_block_hash(k), get_offload_group_idx(k)) for k in keys]

    # ----------------------------------------------------------------- vLLM's interface
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        self._keys[job_metadata.job_id] = keys
        self._stores.add(job_metadata.job_id)
        self.io.store(job_metadata.job_id, self.keys(keys), [int(c) for c in job_metadata.chunk_ids])

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        self._keys[job_metadata.job_id] = keys
        self.io.load(job_metadata.job_id, self.keys(keys), [int(c) for c in job_metadata.chunk_ids])

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        for f in self.io.finished():
            keys = self._keys.pop(f.job_id, [])
            store = f.job_id in self._stores
            self._stores.discard(f.job_id)
            successful = None
            if store:
                if f.success and self.events is not None and keys:
                    self.events.append(OffloadingEvent(keys=keys, medium=self.medium, removed=False,
                                                       locality=self.locality, ownership=OWNERSHIP))
            elif not f.success:
                ok = set(f.ok or ())
                successful = tuple(k for i, k in enumerate(keys) if i in ok) or None
                self._lookups.mark_miss([k for i, k in enumerate(keys) if i not in ok])
            results.append(JobResult(job_id=f.job_id, success=f.success, successful_keys=successful,
                                     transfer_time=f.seconds, transfer_bytes=f.nbytes or None))
        return results

    def has_pending_work(self) -> bool:
        return bool(self._keys)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events:
            events, self.events = self.events, []
            yield from events

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        return  # the pool keeps its own LRU order, bumped by every read

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def drain_jobs(self) -> None:
        self.io.drain()

    def shutdown(self) -> None:
        self._lookups.shutdown()
        self.io.drain(timeout=30.0)
        self.io.close()
        if self._owns_client:
            self.io.client.close()
