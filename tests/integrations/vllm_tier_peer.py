"""One vLLM instance's tiering manager with the TensorCast tier, as its own process (no GPU, no model): vLLM's
``TieringOffloadingSpec`` over a CPU primary region, driven as vLLM's scheduler and offloading worker drive it.

    python vllm_tier_peer.py ADDRESS store|load N [--layers L] [--first F] [--hashes HEX,...] [--expect pool]

``store``: the units of blocks F..F+N-1 are written into primary chunks (what the GPU->CPU copy does) and
completed, so that vLLM cascades them to the tier; ``load``: each is looked up (retrying as vLLM's scheduler
does), promoted into the primary region and compared with the bytes it must have (``--expect pool``: the
pool's page under the unit's key, e.g. one a vLLM engine's connector stored). The engine's shape is given by
``--model --tokens --heads --dim --dtype --format``. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import numpy as np
import xxhash
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingEvent,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


def block_hash(i: int) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


def unit_bytes(key: bytes, n: int) -> np.ndarray:
    return np.random.default_rng(xxhash.xxh3_64_intdigest(key)).integers(0, 256, n, dtype=np.uint8)


def spec(args: argparse.Namespace, engine: str, events: bool) -> TieringOffloadingSpec:
    itemsize = np.dtype(args.dtype).itemsize
    per_block = args.layers * 2 * args.heads * args.tokens * args.dim * itemsize  # K and V of every layer
    tier = {"type": "TensorCastTier", "module_path": "tensorcast.integrations.vllm_tier", "address": args.address,
            "enable_kv_events": events, "max_page_bytes": args.max_page, "page_format": args.format}
    layers = tuple(f"model.layers.{i}.self_attn.attn" for i in range(args.layers))
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(args.tokens, layers, 0),),
        worker_kv_bytes_per_block=per_block, enable_kv_cache_events=events,
        extra_config={"cpu_bytes_to_use": 64 * ((per_block + 4095) // 4096 * 4096), "secondary_tiers": [tier]},
        engine_id=engine, model=OffloadingModelConfig(name=args.model, dtype=args.dtype),
        canonical_layout=args.format == "tensorcast", kv_cache_layout="LBHNC",
        cache=OffloadingCacheConfig(tokens_per_hash=args.tokens, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True))
    return TieringOffloadingSpec(config)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("address")
    ap.add_argument("mode", choices=["store", "load"])
    ap.add_argument("n", type=int)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--max-page", type=int, default=64 * 1024)
    ap.add_argument("--model", default="test/tier-model")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--format", default="vllm", choices=["vllm", "tensorcast"])
    ap.add_argument("--hashes", default="", help="comma-separated hex block hashes to load")
    ap.add_argument("--expect", default="generated", choices=["generated", "pool"])
    args = ap.parse_args()
    s = spec(args, f"tier-{args.mode}-{time.time_ns()}", events=True)
    manager = s.get_manager()
    tier = manager.secondary_tiers[0]
    unit = tier.io.unit_bytes
    rows = np.asarray(manager.primary_tier.get_kv_memoryview()).view(np.uint8)
    hashes = [bytes.fromhex(h) for h in args.hashes.split(",") if h] or \
        [block_hash(args.first + i) for i in range(args.n)]
    keys = [make_offload_key(h, 0) for h in hashes]
    ctx = ReqContext(req_id=f"req-{args.mode}")
    manager.on_new_request(ctx)
    out: dict[str, object] = {"unit_bytes": unit, "parts": len(tier.io.parts("x")), "namespace": tier.namespace}
    step = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    if args.mode == "store":
        prepared = manager.prepare_store(keys, ctx)
        assert prepared is not None and list(prepared.keys_to_store) == keys
        for key, chunk in zip(keys, prepared.store_spec.chunk_ids, strict=True):
            rows[int(chunk), :unit] = unit_bytes(key, unit)  # what the GPU->CPU copy writes
        manager.complete_store(keys, ctx, success=True)
        tier.drain_jobs()
        manager.on_schedule_end(step)  # the step that submitted them (it already polled the tiers)
        manager.on_schedule_end(step)  # the next one collects the results
        events = [e for e in manager.take_events() if isinstance(e, OffloadingEvent) and e.ownership]
        out.update(stored=tier.io.stats["stored"], failed=tier.io.stats["failed_jobs"],
                   events=[[k.hex() for k in e.keys] for e in events])
    else:
        states: dict[str, int] = {}
        deadline = time.monotonic() + 30
        pending = list(keys)
        while pending and time.monotonic() < deadline:
            still = []
            for key in pending:
                result = manager.lookup(key, ctx)
                states[result.name] = states.get(result.name, 0) + 1
                if result is not LookupResult.HIT:
                    still.append(key)
                if result is LookupResult.MISS:
                    break  # a prefix: vLLM stops at the first miss too
            pending = still if not (still and states.get("MISS")) else []
            manager.on_schedule_end(step)  # flush lookups and promotions, as each scheduler step does
            time.sleep(0.01)
        hits = [k for k in keys if k not in pending and not states.get("MISS")] if not pending else []
        exact = True
        if hits:
            loaded = manager.prepare_load(hits, ctx)
            expected = tier.io.client.kv.get(tier.keys(hits)) if args.expect == "pool" else \
                [unit_bytes(key, unit) for key in hits]
            for want, chunk in zip(expected, loaded.chunk_ids, strict=True):
                exact = exact and want is not None and bool(np.array_equal(rows[int(chunk), :unit], want))
            manager.complete_load(hits, ctx)
        out.update(hits=len(hits), exact=exact, states=states, loaded=tier.io.stats["loaded"],
                   misses=tier.io.stats["load_misses"])
    manager.on_request_finished(ctx) if hasattr(manager, "on_request_finished") else None
    manager.shutdown()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
