"""KV pages: batched put/get/exists throughput with shard homes, vs page locations in the global store,
vs Mooncake Store on the same pages — all measured in one run.

Configurations:
- tensorcast, 1/2/4 workers (all shard homes), pages of 64 KiB (small model) and 2 MiB (large model);
- the same with ``locations="global-store"``: every batch also records/looks up per-page locations in the
  global store (what shard homes exist to avoid);
- ``exists`` of a batch of 256 keys (the prefix lookup an engine makes per request), per system, through
  the synchronous ``client.kv`` as an engine calls it (same host: answered from the homes' presence tables
  on the caller's thread); the JSON also has it through the asyncio client (one hop to its event loop) and
  with every lookup asked of the homes (``kv.same_host_exists`` off: the round trip);
- pages that are blocks of a paged cache (``put_blocks``/``get_blocks``: one page = one block of every
  layer's K and V, i.e. ``regions`` rows of equal size), vs Mooncake's multi-buffer batch calls on the same
  regions;
- an index-only round trip to a shard home vs the page round trip, to weigh "bytes on the shard home"
  against "bytes on the writer's worker, index on the shard home" (which adds that round trip to a get);
- the same with ``kv.replicas=2`` (every page also copied to a backup home before a put is acknowledged),
  to price that safety against one copy;
- Mooncake Store (``mooncake-transfer-engine-non-cuda``, ``mooncake_master`` on loopback, TCP protocol;
  batch_put_from / batch_get_into on registered buffers), if installed: ``pip install .[bench]`` and
  Debian ``libibverbs1``. Its HTTP metadata server binds all interfaces: run this only on a host with no
  other exposure; all traffic here goes to loopback.

Every timed call is warmed up first (both systems): Mooncake's first gets into fresh buffers run several
times slower than its steady state, which best-of-a-few would otherwise report. Times are the best of
``reps`` calls.

``--metrics off`` runs with metrics recording off (``benchmarks/metrics_cost.py`` compares both in one run).

``--smoke``: 64 KiB pages only, batches of 32, 1 and 2 workers, one call timed (figures meaningless; every
system's row).

Usage: python benchmarks/kv_pages.py [--quick | --smoke] [--json PATH] [--metrics on|off]
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

import tensorcast as tc
from benchlib import Table, best_of, free_port, metrics_switch, parse_args, parser, pick, write_json
from tensorcast.client.kv import AsyncKV
from tensorcast.client.sync import KV
from tensorcast.kv.blocks import BlockRegions

KiB, MiB = 1 << 10, 1 << 20
EXISTS_BATCH = 256
WARMUP = 5


def make_pages(n: int, size: int, seed: int) -> tuple[list[str], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    keys = [f"{seed:08x}{i:024x}" for i in range(n)]
    base = rng.integers(0, 255, size, dtype=np.uint8)
    pages = [np.roll(base, i) for i in range(n)]
    return keys, pages


def exists_batch(keys: list[str]) -> list[str]:
    """``EXISTS_BATCH`` stored keys (cycled when fewer are stored)."""
    return [keys[i % len(keys)] for i in range(EXISTS_BATCH)]


def fresh(keys: list[str]) -> list[str]:
    """Keys never stored before, so that every timed put really stores."""
    return [f"{time.perf_counter_ns():016x}{k[16:]}" for k in keys]


def timed(fn: Callable[[], object], reps: int) -> float:
    for _ in range(WARMUP):
        fn()
    return best_of(fn, reps)


def cache_regions(n: int, page: int, regions: int) -> tuple[BlockRegions, list[np.ndarray], np.ndarray]:
    """A paged cache of ``2n`` blocks in ``regions`` arrays (one per layer and K/V); the pages go to every other
    block (block ids are not contiguous in an engine's cache either)."""
    arrays = [np.zeros((2 * n, page // regions), np.uint8) for _ in range(regions)]
    return BlockRegions(arrays), arrays, np.arange(n, dtype=np.int64) * 2


def bench_tensorcast(workers: int, page: int, n: int, reps: int, locations: str,
                     metrics_on: bool = True, regions: int = 0, replicas: int = 1) -> dict[str, float]:
    keys, pages = make_pages(n, page, seed=page + workers)
    # Steady state of a page cache, like Mooncake's pre-mounted segment: the store is already full, so new
    # pages reuse evicted slots of existing (pre-faulted) arenas instead of faulting in fresh memory.
    capacity = 3 * n * page
    config = {"kv.memory_capacity": capacity * replicas, "kv.replicas": replicas, **metrics_switch(metrics_on),
              "gs.page_index": locations == "global-store"}  # the store serves its page index only when asked
    with tc.LocalCluster(workers=workers, config=config) as cluster, \
            tc.connect(cluster.address) as client:
        deadline = time.time() + 20
        while time.time() < deadline:
            t = client.list_shards()
            if len(t.leases) == t.num_shards and all(lease.holder for lease in t.leases):
                break
            time.sleep(0.1)
        time.sleep(1.5)  # let HRW assignment converge
        kv = AsyncKV(client.aio.caller, client.aio.locality, client.aio.config.kv, locations=locations)
        run = client._run
        for warm in range(3 * workers + 1):  # fill every home's store once (untimed)
            run(kv.put([f"{warm:08x}{k[8:]}" for k in keys], pages))
        t_put = best_of(lambda: run(kv.put(fresh(keys), pages)), reps)
        run(kv.put(keys, pages))
        bufs = [np.empty(page, np.uint8) for _ in keys]
        t_get = timed(lambda: run(kv.get_into(keys, bufs)), reps)
        assert all(np.array_equal(b, p) for b, p in zip(bufs[:3], pages[:3], strict=True))
        probe = exists_batch(keys)
        # Lookups as an engine makes them (the sync client), through the asyncio client, and all asked.
        asked = AsyncKV(client.aio.caller, client.aio.locality,
                        msgspec.structs.replace(client.aio.config.kv, same_host_exists=False))
        t_exists = timed(lambda: KV(run, kv).exists(probe), reps * 4)
        t_exists_async = timed(lambda: run(kv.exists(probe)), reps * 4)
        t_exists_asked = timed(lambda: run(asked.exists(probe)), reps * 4)
        one = keys[:1]
        t_index_rt = timed(lambda: run(asked.exists(one)), reps * 20)
        t_page_rt = timed(lambda: run(kv.get_into(one, bufs[:1])), reps * 20)
        out = {"put_pages_s": n / t_put, "put_GBps": n * page / t_put / 1e9, "get_pages_s": n / t_get,
               "get_GBps": n * page / t_get / 1e9, "exists_keys_s": EXISTS_BATCH / t_exists,
               "exists_async_keys_s": EXISTS_BATCH / t_exists_async,
               "exists_asked_keys_s": EXISTS_BATCH / t_exists_asked,
               "index_rtt_ms": t_index_rt * 1e3, "page_rtt_ms": t_page_rt * 1e3}
        if regions:
            out.update(_blocks(run, kv, keys, page, regions, reps))
        run(kv.aclose())
        run(asked.aclose())
    return out


def _blocks(run: Callable[[Any], Any], kv: AsyncKV, keys: list[str], page: int, regions: int,
            reps: int) -> dict[str, float]:
    """put_blocks / get_blocks of the same pages, as blocks of a paged cache."""
    n = len(keys)
    keys = [f"b{k[1:]}" for k in keys]  # not the pages stored already (a stored key is not stored again)
    cache, arrays, blocks = cache_regions(n, page, regions)
    for a in arrays:
        a[:] = 7
    t_put = best_of(lambda: run(kv.put_blocks(fresh(keys), blocks, cache)), reps)
    run(kv.put_blocks(keys, blocks, cache))
    for a in arrays:
        a[:] = 0
    t_get = timed(lambda: run(kv.get_blocks(keys, blocks, cache)), reps)
    assert all((a[blocks] == 7).all() and not a[1::2].any() for a in arrays)
    return {"blocks_put_pages_s": n / t_put, "blocks_put_GBps": n * page / t_put / 1e9,
            "blocks_get_pages_s": n / t_get, "blocks_get_GBps": n * page / t_get / 1e9}


def bench_mooncake(page: int, n: int, reps: int, regions: int = 0) -> dict[str, float] | None:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError:
        return None
    master = shutil.which("mooncake_master") or os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    if not os.path.exists(master):
        return None
    rpc, http = free_port(), free_port()
    proc = subprocess.Popen([master, f"--rpc_port={rpc}", "--enable_http_metadata_server=true",
                             "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={http}",
                             "--rpc_address=127.0.0.1", f"--metrics_port={free_port()}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.5)
        store = MooncakeDistributedStore()
        segment = max(12 * n * page, 256 * MiB)  # every timed put stores new keys
        rc = store.setup("127.0.0.1", f"http://127.0.0.1:{http}/metadata", segment, 2 * n * page + 64 * MiB,
                         "tcp", "", f"127.0.0.1:{rpc}")
        if rc != 0:
            return None
        keys, pages = make_pages(n, page, seed=page)
        src = np.concatenate(pages)
        dst = np.empty_like(src)
        store.register_buffer(src.ctypes.data, src.nbytes)
        store.register_buffer(dst.ctypes.data, dst.nbytes)
        ptrs = [src.ctypes.data + i * page for i in range(n)]
        dptrs = [dst.ctypes.data + i * page for i in range(n)]
        sizes = [page] * n

        def put() -> None:
            res = store.batch_put_from(fresh(keys), ptrs, sizes)
            assert all(r == 0 for r in res), res[:3]

        t_put = best_of(put, reps)
        store.batch_put_from(keys, ptrs, sizes)
        t_get = timed(lambda: store.batch_get_into(keys, dptrs, sizes), reps)
        assert np.array_equal(dst[:page], src[:page])
        probe = exists_batch(keys)
        t_exists = timed(lambda: store.batch_is_exist(probe), reps * 4)
        total = n * page
        out = {"put_pages_s": n / t_put, "put_GBps": total / t_put / 1e9, "get_pages_s": n / t_get,
               "get_GBps": total / t_get / 1e9, "exists_keys_s": EXISTS_BATCH / t_exists}
        if regions:
            out.update(_mooncake_blocks(store, page, n, regions, reps))
        store.close()
        return out
    finally:
        proc.kill()
        proc.wait()


def _mooncake_blocks(store: Any, page: int, n: int, regions: int, reps: int) -> dict[str, float]:
    """The same paged cache with Mooncake's multi-buffer batch calls: each page from / into its block's row of
    every region (registered buffers)."""
    _, arrays, blocks = cache_regions(n, page, regions)
    width = page // regions
    for a in arrays:
        a[:] = 7
        store.register_buffer(a.ctypes.data, a.nbytes)
    rows = [[a.ctypes.data + int(b) * a.strides[0] for a in arrays] for b in blocks]
    widths = [[width] * regions for _ in blocks]
    keys = [f"blocks{i:026x}" for i in range(n)]

    def put() -> None:
        res = store.batch_put_from_multi_buffers(fresh(keys), rows, widths)
        assert all(r == 0 for r in res), res[:3]

    t_put = best_of(put, reps)
    store.batch_put_from_multi_buffers(keys, rows, widths)
    for a in arrays:
        a[:] = 0
    t_get = timed(lambda: store.batch_get_into_multi_buffers(keys, rows, widths), reps)
    assert all((a[blocks] == 7).all() for a in arrays)
    return {"blocks_put_pages_s": n / t_put, "blocks_put_GBps": n * page / t_put / 1e9,
            "blocks_get_pages_s": n / t_get, "blocks_get_GBps": n * page / t_get / 1e9}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--metrics", choices=["on", "off"], default="on", help="metrics recording (default on)")
    args = parse_args(ap)
    on = args.metrics == "on"
    reps = pick(args, 5, 3, 1)
    # (page bytes, pages per batch, regions of a block: e.g. 16 layers x K/V, 32 layers x K/V)
    cases = pick(args, [(64 * KiB, 1024, 32), (2 * MiB, 128, 64)], [(64 * KiB, 256, 32), (2 * MiB, 32, 64)],
                 [(64 * KiB, 32, 32)])  # --smoke: one page size (every system and row; a cluster is seconds)
    worker_counts = pick(args, [1, 2, 4], [1, 2], [1, 2])
    rows: list[dict[str, Any]] = []
    table = Table(("system", "<30"), ("page", ">7"), ("pages", ">6"), ("put pages/s", ">12,.0f"),
                  ("put GB/s", ">9.2f"), ("get pages/s", ">12,.0f"), ("get GB/s", ">9.2f"),
                  ("exists keys/s", ">14,.0f"))
    table.header()

    def show(name: str, page: int, n: int, r: dict[str, float]) -> None:
        rows.append({"system": name, "page_bytes": page, "pages": n, **r})
        table.row(name, f"{page // KiB}Ki", n, r["put_pages_s"], r["put_GBps"], r["get_pages_s"], r["get_GBps"],
                  r["exists_keys_s"])
        if "blocks_get_pages_s" in r:
            table.row(f"  ...as blocks of {r['regions']} regions", "", "", r["blocks_put_pages_s"],
                      r["blocks_put_GBps"], r["blocks_get_pages_s"], r["blocks_get_GBps"], "")

    for page, n, regions in cases:
        for w in worker_counts:
            r = bench_tensorcast(w, page, n, reps, "shard-homes", on, regions=regions if w == 1 else 0)
            show(f"tensorcast shard homes, {w}w", page, n, {**r, "regions": regions} if w == 1 else r)
        show("tensorcast GS page index, 2w", page, n, bench_tensorcast(2, page, n, reps, "global-store", on))
        show("tensorcast kv.replicas=2, 2w", page, n, bench_tensorcast(2, page, n, reps, "shard-homes", on,
                                                                      replicas=2))
        mc = bench_mooncake(page, n, reps, regions)
        if mc is not None:
            show("mooncake store (tcp)", page, n, {**mc, "regions": regions})
        else:
            print(f"{'mooncake store':<30} not installed (pip install .[bench]; apt libibverbs1)")
    print()
    summary(rows, cases)
    write_json(args.json, "kv_pages", args.quick, metrics=args.metrics, rows=rows)


def summary(rows: list[dict[str, Any]], cases: list[tuple[int, int, int]]) -> None:
    """Ratios to Mooncake measured in this run, and the round trips."""
    for page, _, _ in cases:
        ours = [r for r in rows if r["page_bytes"] == page and r["system"].startswith("tensorcast shard homes")]
        two = [r for r in rows if r["page_bytes"] == page and r["system"] == "tensorcast shard homes, 2w"]
        backed = [r for r in rows if r["page_bytes"] == page and r["system"].startswith("tensorcast kv.replicas=2")]
        if two and backed:
            put, get = (backed[0][f] / two[0][f] for f in ("put_GBps", "get_GBps"))
            print(f"{page // KiB} KiB pages: kv.replicas=2 vs 1 (2 workers): put {put:.2f}x, get {get:.2f}x")
        mc_rows = [r for r in rows if r["page_bytes"] == page and r["system"].startswith("mooncake")]
        best = max(ours, key=lambda r: r["get_GBps"])
        size = f"{page // KiB} KiB pages"
        if mc_rows:
            m = mc_rows[0]
            exists = max(r["exists_keys_s"] for r in ours) / m["exists_keys_s"]
            print(f"{size}: get {best['get_GBps'] / m['get_GBps']:.2f}x, "
                  f"put {max(r['put_GBps'] for r in ours) / m['put_GBps']:.2f}x Mooncake (goal >= 1.5x); exists "
                  f"({EXISTS_BATCH} keys) {exists:.2f}x (goal >= 1x)")
            blocks = [r for r in ours if "blocks_get_pages_s" in r]
            if blocks and "blocks_get_pages_s" in m:
                b = blocks[0]
                print(f"{size} as blocks: get_blocks {b['blocks_get_pages_s'] / m['blocks_get_pages_s']:.2f}x, "
                      f"put_blocks {b['blocks_put_pages_s'] / m['blocks_put_pages_s']:.2f}x Mooncake multi-buffer")
        print(f"{size}: exists ({EXISTS_BATCH} keys) through the asyncio client "
              f"{max(r['exists_async_keys_s'] for r in ours):,.0f} keys/s, every lookup asked of the homes "
              f"{max(r['exists_asked_keys_s'] for r in ours):,.0f} keys/s")
        print(f"{size}: index-only round trip {best['index_rtt_ms']:.3f} ms, page round trip "
              f"{best['page_rtt_ms']:.3f} ms -> keeping bytes on the writer would add ~{best['index_rtt_ms']:.3f} ms "
              f"per get")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
