"""KV pages: batched put/get/exists throughput with shard homes, vs page locations in the global store,
vs Mooncake Store on the same pages — all measured in one run.

Configurations:
- tensorcast, 1/2/4 workers (all shard homes), pages of 64 KiB (small model) and 2 MiB (large model);
- the same with ``locations="global-store"``: every batch also records/looks up per-page locations in the
  global store (what shard homes exist to avoid);
- an index-only round trip to a shard home vs the page round trip, to weigh "bytes on the shard home"
  against "bytes on the writer's worker, index on the shard home" (which adds that round trip to a get);
- Mooncake Store (``mooncake-transfer-engine-non-cuda``, ``mooncake_master`` on loopback, TCP protocol;
  batch_put_from / batch_get_into on registered buffers), if installed: ``pip install .[bench]`` and
  Debian ``libibverbs1``. Its HTTP metadata server binds all interfaces: run this only on a host with no
  other exposure; all traffic here goes to loopback.

``--metrics off`` runs with metrics recording off (``benchmarks/metrics_cost.py`` compares both in one run).

Usage: python benchmarks/kv_pages.py [--quick] [--json PATH] [--metrics on|off]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from typing import Any

import numpy as np

import tensorcast as tc
from benchlib import best_of, metrics_switch, write_json
from tensorcast.client.kv import AsyncKV

KiB, MiB = 1 << 10, 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_pages(n: int, size: int, seed: int) -> tuple[list[str], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    keys = [f"{seed:08x}{i:024x}" for i in range(n)]
    base = rng.integers(0, 255, size, dtype=np.uint8)
    pages = [np.roll(base, i) for i in range(n)]
    return keys, pages


def bench_tensorcast(workers: int, page: int, n: int, reps: int, locations: str,
                     metrics_on: bool = True) -> dict[str, float]:
    keys, pages = make_pages(n, page, seed=page + workers)
    # Steady state of a page cache, like Mooncake's pre-mounted segment: the store is already full, so new
    # pages reuse evicted slots of existing (pre-faulted) arenas instead of faulting in fresh memory.
    capacity = 3 * n * page
    config = {"kv.memory_capacity": capacity, **metrics_switch(metrics_on)}
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
        for warm in range(3 * workers + 1):  # fill every home's store once (untimed)
            client._run(kv.put([f"{warm:08x}{k[8:]}" for k in keys], pages))

        def put() -> None:
            # Fresh keys each repetition, so every put really stores.
            ks = [f"{time.perf_counter_ns():016x}{k[16:]}" for k in keys]
            client._run(kv.put(ks, pages))

        t_put = best_of(put, reps)
        client._run(kv.put(keys, pages))
        bufs = [np.empty(page, np.uint8) for _ in keys]
        t_get = best_of(lambda: client._run(kv.get_into(keys, bufs)), reps)
        assert all(np.array_equal(b, p) for b, p in zip(bufs[:3], pages[:3], strict=True))
        t_exists = best_of(lambda: client._run(kv.exists(keys)), reps)
        one = keys[:1]
        t_index_rt = best_of(lambda: client._run(kv.exists(one)), reps * 20)
        t_page_rt = best_of(lambda: client._run(kv.get_into(one, bufs[:1])), reps * 20)
        client._run(kv.aclose())
    total = n * page
    return {"put_pages_s": n / t_put, "put_GBps": total / t_put / 1e9, "get_pages_s": n / t_get,
            "get_GBps": total / t_get / 1e9, "exists_keys_s": n / t_exists,
            "index_rtt_ms": t_index_rt * 1e3, "page_rtt_ms": t_page_rt * 1e3}


def bench_mooncake(page: int, n: int, reps: int) -> dict[str, float] | None:
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
        segment = max(4 * n * page, 256 * MiB)
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
            ks = [f"{time.perf_counter_ns():016x}{k[16:]}" for k in keys]
            res = store.batch_put_from(ks, ptrs, sizes)
            assert all(r == 0 for r in res), res[:3]

        t_put = best_of(put, reps)
        store.batch_put_from(keys, ptrs, sizes)
        t_get = best_of(lambda: store.batch_get_into(keys, dptrs, sizes), reps)
        assert np.array_equal(dst[:page], src[:page])
        t_exists = best_of(lambda: store.batch_is_exist(keys), reps)
        store.close()
        total = n * page
        return {"put_pages_s": n / t_put, "put_GBps": total / t_put / 1e9, "get_pages_s": n / t_get,
                "get_GBps": total / t_get / 1e9, "exists_keys_s": n / t_exists}
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--metrics", choices=["on", "off"], default="on", help="metrics recording (default on)")
    args = ap.parse_args()
    on = args.metrics == "on"
    reps = 3
    cases = [(64 * KiB, 256 if args.quick else 1024), (2 * MiB, 32 if args.quick else 128)]
    worker_counts = [1, 2] if args.quick else [1, 2, 4]
    rows: list[dict[str, Any]] = []
    hdr = (f"{'system':<30} {'page':>7} {'pages':>6} {'put pages/s':>12} {'put GB/s':>9} {'get pages/s':>12} "
           f"{'get GB/s':>9} {'exists keys/s':>14}")
    print(hdr)
    print("-" * len(hdr))

    def show(name: str, page: int, n: int, r: dict[str, float]) -> None:
        rows.append({"system": name, "page_bytes": page, "pages": n, **r})
        print(f"{name:<30} {page // KiB:>5}Ki {n:>6} {r['put_pages_s']:>12,.0f} {r['put_GBps']:>9.2f} "
              f"{r['get_pages_s']:>12,.0f} {r['get_GBps']:>9.2f} {r['exists_keys_s']:>14,.0f}")

    for page, n in cases:
        for w in worker_counts:
            show(f"tensorcast shard homes, {w}w", page, n, bench_tensorcast(w, page, n, reps, "shard-homes", on))
        show("tensorcast GS page index, 2w", page, n, bench_tensorcast(2, page, n, reps, "global-store", on))
        mc = bench_mooncake(page, n, reps)
        if mc is not None:
            show("mooncake store (tcp)", page, n, mc)
        else:
            print(f"{'mooncake store':<30} not installed (pip install .[bench]; apt libibverbs1)")
    print()
    for page, _ in cases:
        ours = [r for r in rows if r["page_bytes"] == page and r["system"].startswith("tensorcast shard homes")]
        mc_rows = [r for r in rows if r["page_bytes"] == page and r["system"].startswith("mooncake")]
        best = max(ours, key=lambda r: r["get_GBps"])
        if mc_rows:
            m = mc_rows[0]
            print(f"{page // KiB} KiB pages: get {best['get_GBps'] / m['get_GBps']:.2f}x, "
                  f"put {max(r['put_GBps'] for r in ours) / m['put_GBps']:.2f}x Mooncake (goal >= 1.5x)")
        print(f"{page // KiB} KiB pages: index-only round trip {best['index_rtt_ms']:.3f} ms, page round trip "
              f"{best['page_rtt_ms']:.3f} ms -> keeping bytes on the writer would add ~{best['index_rtt_ms']:.3f} ms "
              f"per get")
    write_json(args.json, "kv_pages", args.quick, metrics=args.metrics, rows=rows)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
