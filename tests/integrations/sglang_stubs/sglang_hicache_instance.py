"""One SGLang instance's HiCache storage path on CPU, run as its own process by tests/integrations/test_sglang.py.

``python -m sglang_hicache_instance ROLE ADDRESS OUTDIR`` (with this folder on ``PYTHONPATH``, for the
torchvision stand-in). SGLang's real classes are used throughout: a CPU ``MHATokenToKVPool`` and
``PagedTokenToKVPoolAllocator``, an ``MHATokenToKVPoolHost`` (page_first, ``pin_memory=False``) and a
``HiCacheController`` that creates its storage backend through SGLang's factory, as a server does:

- ``ours``: ``tensorcast.integrations.sglang`` loaded with ``--hicache-storage-backend dynamic``
  (``interface_v1``: zero-copy), and in role ``b`` also without ``interface_v1`` (the legacy flat-page calls);
- ``upstream``: SGLang's bundled ``tensorcast`` backend (``TensorcastStore``) on ``tensorcast.api.store``,
  in allocator mode in role ``a`` and scratch mode in role ``b``.

Role ``a`` fills its host pool with seeded random KV, then backs pages up through the controller's backup
thread. Role ``b`` (another process: instance B) asks the controller's prefetch thread for the same tokens,
allocates host memory for the hits as the scheduler does and lets the controller transfer them. Each role
writes the page bytes it stored or loaded (SGLang's flat data pages) to ``OUTDIR`` and a JSON summary to
stdout's last line, for the test to compare.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tensorcast.api.store import HostMemorySpan

MODEL = "tensorcast-test/tiny-mha"
PAGE = 4  # tokens per page
PAGES = 6  # pages instance A stores
LAYERS, HEADS, HEAD_DIM = 3, 2, 16
TOKENS = [(7919 * i) % 32000 for i in range(PAGES * PAGE)]
UNKNOWN = [31000 + i for i in range(2 * PAGE)]  # tokens nobody stored: two more pages
WAIT = 240.0  # seconds a queue may take on a busy 2-core host


def single_rank() -> None:
    """What SGLang's launcher publishes for one rank (a bare process has no parallel context)."""
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1,
                                        attn_dcp_rank=0, launch_world_rank=0, launch_world_size=1)


def make_pools(host_allocator: Any = None) -> tuple[Any, Any]:
    """A CPU device pool with its page allocator, and a page_first host pool (twice the device's size)."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    device = MHATokenToKVPool(64, PAGE, torch.float16, HEADS, HEAD_DIM, LAYERS, "cpu", False,
                              start_layer=0, end_layer=LAYERS)
    allocator = PagedTokenToKVPoolAllocator(64, PAGE, torch.float16, "cpu", device, False)
    # SGLang sizes host pools against free RAM minus a large fixed reserve, which a busy test host may not
    # have; this pool is a few KiB, so book it against an explicit budget instead.
    with host_memory_budget_scope(64 << 20):
        host = MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, "page_first",
                                    pin_memory=False, device_capacity_tokens=device.size, start_layer=0,
                                    end_layer=LAYERS)
    if host_allocator is not None:
        # What SGLang does with ``allocator_type="tensorcast"``, which it only selects on CUDA: the host
        # pool's buffer comes from the TensorCast session's allocator.
        host.allocator = host_allocator
        host.kv_buffer = host.init_kv_buffer()
    return allocator, host


def controller(allocator: Any, host: Any, backend: str, extra: dict[str, Any], metrics: bool = False) -> Any:
    from sglang.srt.managers.cache_controller import HiCacheController

    return HiCacheController(allocator, host, PAGE, None, threading.Event(), io_backend="direct",
                             storage_backend=backend, model_name=MODEL, storage_backend_extra_config=extra,
                             enable_storage_metrics=metrics)


def ours(address: str | None, *, v1: bool = True, model: str | None = None) -> dict[str, Any]:
    extra: dict[str, Any] = {"backend_name": "tensorcast", "module_path": "tensorcast.integrations.sglang",
                             "class_name": "TensorCastHiCacheStorage"}
    if address:
        extra["address"] = address
    if v1:
        extra["interface_v1"] = 1
    if model:
        extra["model_id"] = model
    return extra


def upstream(address: str, mode: str) -> dict[str, Any]:
    return {"tensorcast": {"daemon_address": address, "transfer_mode": mode, "model_id": MODEL,
                           "scratch": {"capacity_bytes": 8 << 20}}}


def attach_upstream_session(extra: dict[str, Any]) -> Any:
    """SGLang's early attach (normally from the host pool's allocator choice); returns that allocator."""
    from sglang.srt.mem_cache.storage.tensorcast_store.host_allocator import create_tensorcast_host_allocator

    # is_cuda_backend: SGLang admits this backend only on CUDA; the storage path itself is host memory.
    return create_tensorcast_host_allocator(extra, host_memory_mode="cache", host_layout="page_first",
                                            io_backend="kernel", platform_name="linux", is_cuda_backend=True,
                                            world_rank=0, world_size=1)


def flat_pages(host: Any, indices: torch.Tensor, pages: int) -> np.ndarray:
    """SGLang's flat data pages (K then V of every layer) at ``indices``, as bytes."""
    rows = [host.get_data_page(int(indices[i * PAGE])).contiguous().view(torch.uint8).numpy() for i in range(pages)]
    return np.stack(rows)


def backup(ctrl: Any, host: Any, seed: int) -> tuple[np.ndarray, int, float]:
    """Instance A: random KV in fresh host slots, backed up through the controller; (pages, tokens, s)."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    host.alloc(PAGE)  # start past the first slots, so the two instances' slots differ
    indices = host.alloc(PAGES * PAGE)
    gen = torch.Generator().manual_seed(seed)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=gen).to(host.kv_buffer.dtype))
    hashes = get_storage_hash_str(TOKENS, None, page_size=PAGE)
    t0 = time.perf_counter()
    ctrl.write_storage(indices, TOKENS, hash_value=hashes)
    done = ctrl.ack_backup_queue.get(timeout=WAIT)
    return flat_pages(host, indices, PAGES), done.completed_tokens, time.perf_counter() - t0


def prefetch(ctrl: Any, host: Any, tokens: list[int]) -> tuple[np.ndarray | None, int, int, float]:
    """Instance B: hit query, then the transfer the scheduler starts for the hits;
    (loaded pages, hit tokens, loaded tokens, seconds)."""
    host.kv_buffer.fill_(-7)  # nothing of instance A's values is here before the transfer
    t0 = time.perf_counter()
    op = ctrl.prefetch(f"req-{time.monotonic_ns()}", tokens)
    hit = ctrl.prefetch_hit_queue.get(timeout=WAIT)
    assert hit is op
    if hit.storage_hit_count == 0:
        return None, 0, 0, time.perf_counter() - t0
    indices = ctrl.alloc_prefetch_host_buffers(op, hit.storage_hit_count)
    op.host_indices = indices
    ctrl.prefetch_buffer.put(op)
    loaded = 0
    while True:
        ack = ctrl.ack_prefetch_queue.get(timeout=WAIT)
        if ack.completed_tokens is not None:
            loaded = max(loaded, ack.completed_tokens)
        if ack.completed_req:
            break
    pages = loaded // PAGE
    return flat_pages(host, indices, pages), hit.storage_hit_count, loaded, time.perf_counter() - t0


def role_a(address: str, out: Path) -> dict[str, Any]:
    allocator, host = make_pools()
    ctrl = controller(allocator, host, "dynamic", ours(address))
    pages, tokens, seconds = backup(ctrl, host, seed=1)
    np.save(out / "a_ours.npy", pages)
    summary: dict[str, Any] = {"page": PAGE, "pages": PAGES, "ours_backed_up": tokens, "ours_backup_s": seconds,
                               "ours_prefix": ctrl.storage_backend.key_prefix}

    extra = upstream(address, "allocator")
    session_allocator = attach_upstream_session(extra)
    allocator2, host2 = make_pools(session_allocator)
    ctrl2 = controller(allocator2, host2, "tensorcast", extra)
    pages2, tokens2, seconds2 = backup(ctrl2, host2, seed=2)
    np.save(out / "a_upstream.npy", pages2)
    store = ctrl2.storage_backend
    summary.update(upstream_backed_up=tokens2, upstream_backup_s=seconds2,
                   upstream_allocator=type(host2.allocator).__name__,
                   upstream_region=store.session.region_of(
                       HostMemorySpan.from_tensor(host2.kv_buffer, offset_bytes=0, byte_length=16)),
                   upstream_session_stats=store.session.stats)
    return summary


def role_b(address: str, out: Path) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    allocator, host = make_pools()
    ctrl = controller(allocator, host, "dynamic", ours(address), metrics=True)
    pages, hit, loaded, seconds = prefetch(ctrl, host, TOKENS + UNKNOWN)
    np.save(out / "b_ours.npy", pages)
    summary.update(ours_hit=hit, ours_loaded=loaded, ours_prefetch_s=seconds)
    stats = ctrl.storage_backend.get_stats()
    summary.update(ours_stats_pages=list(stats.prefetch_pgs), ours_stats_after=list(ctrl.storage_backend.get_stats()
                                                                                    .prefetch_pgs))
    summary["ours_unknown_hit"] = prefetch(ctrl, host, UNKNOWN)[1]
    # Another model's keys are another prefix: nothing of this model is found under it. (Its address comes
    # from TENSORCAST_ADDRESS, the fallback when the extra config names none.)
    os.environ["TENSORCAST_ADDRESS"] = address
    other = controller(*make_pools(), "dynamic", ours(None, model="tensorcast-test/another-model"))
    summary["other_model_hit"] = prefetch(other, other.mem_pool_host, TOKENS)[1]

    allocator3, host3 = make_pools()
    legacy = controller(allocator3, host3, "dynamic", ours(address, v1=False))
    pages3, _, loaded3, _ = prefetch(legacy, host3, TOKENS)
    np.save(out / "b_legacy.npy", pages3)
    summary.update(legacy_loaded=loaded3, legacy_zero_copy=legacy.page_get_func == legacy._page_get_zero_copy)

    extra = upstream(address, "scratch")
    attach_upstream_session(extra)
    allocator4, host4 = make_pools()
    ctrl4 = controller(allocator4, host4, "tensorcast", extra)
    pages4, hit4, loaded4, seconds4 = prefetch(ctrl4, host4, TOKENS + UNKNOWN)
    np.save(out / "b_upstream.npy", pages4)
    summary.update(upstream_hit=hit4, upstream_loaded=loaded4, upstream_prefetch_s=seconds4,
                   upstream_session_stats=ctrl4.storage_backend.session.stats)

    # clear(): this backend's earlier pages are no longer found (the next key generation).
    ctrl.storage_backend.clear()
    summary["ours_hit_after_clear"] = prefetch(ctrl, host, TOKENS)[1]
    return summary


def main() -> None:
    role, address, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    single_rank()
    summary = role_a(address, out) if role == "a" else role_b(address, out)
    print("RESULT " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
