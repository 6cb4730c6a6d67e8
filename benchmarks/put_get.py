"""Put and get throughput on one host, against numpy.copyto of the same bytes measured in the same run.

Paths measured for each size:
- put (same host): hash (BLAKE3) + one copy into the worker's shared memory + commit at the global store;
- put (remote): the same bytes streamed over loopback TCP (client pretends to be on another host);
- tensor() (same host): map the pool's segment copy-on-write; must stay flat as size grows (no copy);
- tensor() (remote): streamed into a fresh buffer and digest-checked;
- baseline: np.copyto into an already-touched buffer of the same size.

``--metrics off`` runs the cluster and this process with metrics recording off (``benchmarks/metrics_cost.py``
compares the two in one run).

Usage: python benchmarks/put_get.py [--quick] [--json PATH] [--metrics on|off]
"""

from __future__ import annotations

import argparse

import numpy as np

import tensorcast as tc
from benchlib import best_of, fmt_size, metrics_switch, write_json


def measure(sizes: list[int], metrics_on: bool = True) -> list[dict[str, float]]:
    """Put and get times per size (best of a few), and memcpy's, on a fresh one-worker cluster."""
    rows = []
    config = metrics_switch(metrics_on)
    remote_cfg = tc.Config.from_flat({"client.host_id": "bench-remote-host"})
    with tc.LocalCluster(workers=1, memory_capacity="6GiB", config=config) as cluster, \
            tc.connect(cluster.address) as local, tc.connect(cluster.address, config=remote_cfg) as remote:
        for size in sizes:
            reps = 5 if size <= 16 << 20 else 3 if size <= 256 << 20 else 2
            data = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
            dst = np.ones_like(data)
            t_copy = best_of(lambda: np.copyto(dst, data), reps)  # noqa: B023

            def put_local() -> None:
                art = local.put(data)  # noqa: B023
                local.delete(art.id)

            def put_remote() -> None:
                art = remote.put(data)  # noqa: B023
                remote.delete(art.id)

            t_put_local = best_of(put_local, reps)
            t_put_remote = best_of(put_remote, reps)
            art = local.put(data)
            t_get_local = best_of(lambda: art.tensor(like="numpy"), reps)  # noqa: B023
            t_get_remote = best_of(lambda: remote.artifact(art.id).tensor(like="numpy"), reps)  # noqa: B023
            got = art.tensor(like="numpy")
            assert np.array_equal(got[:: max(1, size // 4096)], data[:: max(1, size // 4096)])
            local.delete(art.id)
            gbps = lambda t: size / t / 1e9  # noqa: E731, B023
            rows.append({
                "size": size, "memcpy_s": t_copy, "put_local_s": t_put_local, "put_remote_s": t_put_remote,
                "get_local_s": t_get_local, "get_remote_s": t_get_remote,
                "memcpy_GBps": gbps(t_copy), "put_local_GBps": gbps(t_put_local),
                "put_remote_GBps": gbps(t_put_remote), "get_remote_GBps": gbps(t_get_remote),
                "put_local_vs_memcpy": t_copy / t_put_local, "get_remote_vs_memcpy": t_copy / t_get_remote,
            })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (about a minute)")
    ap.add_argument("--json", default=None, help="write results to this JSON file")
    ap.add_argument("--metrics", choices=["on", "off"], default="on", help="metrics recording (default on)")
    args = ap.parse_args()

    sizes = [4 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20] if args.quick else \
        [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30]
    rows = measure(sizes, args.metrics == "on")
    hdr = (f"{'size':>8} {'memcpy GB/s':>11} {'put shm GB/s':>12} {'(x memcpy)':>10} {'put tcp GB/s':>12} "
           f"{'get shm ms':>10} {'get tcp GB/s':>12} {'(x memcpy)':>10}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{fmt_size(r['size']):>8} {r['memcpy_GBps']:>11.2f} {r['put_local_GBps']:>12.2f} "
              f"{r['put_local_vs_memcpy']:>10.2f} {r['put_remote_GBps']:>12.2f} {r['get_local_s'] * 1e3:>10.3f} "
              f"{r['get_remote_GBps']:>12.2f} {r['get_remote_vs_memcpy']:>10.2f}")
    small, large = rows[0], rows[-1]
    flat = large["get_local_s"] / small["get_local_s"]
    print(f"\nsame-host tensor(): {small['get_local_s'] * 1e3:.3f} ms at {fmt_size(small['size'])}, "
          f"{large['get_local_s'] * 1e3:.3f} ms at {fmt_size(large['size'])} "
          f"({large['size'] // small['size']}x the bytes, {flat:.1f}x the time: mapped, not copied)")
    write_json(args.json, "put_get", args.quick, metrics=args.metrics, rows=rows)


if __name__ == "__main__":
    main()
