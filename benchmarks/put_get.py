"""Put and get on one host, against numpy.copyto of the same bytes and Ray's object store, both measured in the
same run.

Paths measured for each size:
- put (same host): BLAKE3 digests, then the bytes copied once into the worker's shared memory (through a
  mapping kept between puts), then the commit at the global store; up to 256 KiB, one request that carries
  the bytes;
- put (remote): the same bytes streamed over loopback TCP (client pretends to be on another host);
- tensor() (same host): map the pool's memory copy-on-write; must stay flat as size grows (no copy); timed over
  at least ``GET_REPS`` reads, as is ray.get (the first read asks the worker where the bytes are);
- tensor() (remote): streamed into a fresh buffer and digest-checked;
- baseline: np.copyto into an already-touched buffer of the same size;
- Ray (if installed; ``pip install .[bench]``): ``ray.put`` of the same array, and ``ray.get`` (zero-copy numpy)
  of an object this process put.
Then many small tensors: one artifact of 2,000 tensors of 4 KiB against 2,000 ``ray.put`` calls (objects/s).

Each put holds new content (no deduplication), is timed alone and deleted (untimed) before the next; before each
size the worker's pre-faulted stock is given ``worker.prefault_idle_seconds`` to refill, as between bursts of puts
in service, and then written through once by untimed puts (``warm_puts``): a client keeps its mappings of the
stock's memory from one put to the next, so a client in service writes into pages it has faulted in already; a
client's first pass through fresh memory costs about twice as much per byte (its page faults). Times are medians
(best in the JSON); ratios are to the same run's memcpy and Ray: above 1 is faster than Ray. ``gs ms``: of each
same-host put, the time the global store took to record it (a SQLite commit every put waits for, whatever its size;
without an fsync for an artifact held only in memory). ``--metrics off`` runs the cluster and this process with
metrics recording off (``benchmarks/metrics_cost.py`` compares the two in one run).

With ``--tls``, instead: what TLS costs a caller, against the plain-text path in the same run. Two one-worker
clusters alike but for TLS (both with a token), their calls interleaved: put and tensor() on the same host
(the bytes go through shared memory; TLS carries the control messages) and from another host (the bytes cross
TLS); ratio = median plain / median TLS (1: free); then the price of opening a connection
(``tlslib.handshakes``): without a token, with the challenge-response, with TLS too.

``--smoke``: two sizes (4 KiB, one request; 1 MiB, through shared memory), 200 small tensors, a worker stock of
64 MiB (figures meaningless; every path and row).

Usage: python benchmarks/put_get.py [--quick | --smoke] [--tls] [--json PATH] [--metrics on|off]
       [--set KEY=VALUE ...]
"""

from __future__ import annotations

import functools
import re
import statistics
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import numpy as np

import tensorcast as tc
import tlslib
from benchlib import SMOKE_STOCK, Table, fmt_size, metrics_switch, parse_args, parser, pick, shm_pages, write_json

SMALL, SMALL_COUNT = 4 << 10, 2000
# Same-host reads (tensor(), ray.get) of one object, at every size: each takes microseconds once the first few
# reads have set up their mapping (the first asks the worker where the bytes are), so a median of 3-5 would
# report those first reads rather than the reads of a client in service.
GET_REPS = 30
# --smoke: a small stock (the untimed puts that write it through are then few), refilled soon after a put.
SMOKE_CONFIG = {"worker.prefault_bytes": "64MiB", **SMOKE_STOCK}


def count(size: int, reps: int) -> int:
    """Repetitions for ``size``: small ones are quick and noisier (a vCPU waking up, a thread hop), so more."""
    return max(reps, 30) if size <= 1 << 20 else reps if size <= 16 << 20 else max(3, reps // 2) \
        if size <= 64 << 20 else 3


def times(fn: Callable[[], Any], reps: int, after: Callable[[Any], object] = lambda _: None) -> list[float]:
    """Wall times of ``reps`` calls of ``fn``; ``after`` gets each result, untimed (e.g. to delete it)."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        got = fn()
        out.append(time.perf_counter() - t0)
        after(got)
    return out


def fresh(data: np.ndarray[Any, Any], i: int) -> np.ndarray[Any, Any]:
    """``data`` with its first 8 bytes replaced by ``i``: new content, so a put deduplicates nothing."""
    data[:8] = np.frombuffer(np.int64(i).tobytes(), np.uint8)
    return data


def warm_puts(cluster: tc.LocalCluster, size: int) -> int:
    """Untimed puts of ``size`` before the timed ones: enough to write through the worker's pre-faulted stock
    once (a client in service has, and keeps its mappings of it: ``client.write_maps``), at least one (the
    first request after a quiet spell). A small put's bytes travel with its request: one is enough."""
    if size <= 256 << 10:
        return 1
    worker = cluster.client_config().worker  # the cluster's, ``--set`` included
    return max(1, min(1000, (worker.prefault_bytes + worker.prefault_chunk_bytes) // size))


def _quiet(cluster: tc.LocalCluster) -> None:
    """Let the worker refill its pre-faulted stock (it does so after a quiet spell)."""
    time.sleep(cluster.client_config().worker.prefault_idle_seconds + 1.0)


def gs_commits(cluster: tc.LocalCluster) -> tuple[float, float]:
    """Seconds the global store spent serving CommitArtifact so far, and how many (0, 0 with metrics off):
    every put waits for one (a durable SQLite commit), whatever its size."""
    url = cluster.metrics_urls.get("gs")
    if not url:
        return 0.0, 0.0
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    got = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^tensorcast_rpc_served_seconds_(sum|count)\{method="CommitArtifact"\} (\S+)$', text, re.M)}
    return got.get("sum", 0.0), got.get("count", 0.0)


def measure(sizes: list[int], metrics_on: bool = True, reps: int = 5,
            overrides: dict[str, str] | None = None) -> list[dict[str, float]]:
    """Put and get times per size (median and best of ``reps``), and memcpy's, on a fresh one-worker cluster
    (configured with ``overrides`` too)."""
    rows = []
    config = {**metrics_switch(metrics_on), **(overrides or {})}
    remote_cfg = tc.Config.from_flat({"client.host_id": "bench-remote-host"})
    with tc.LocalCluster(workers=1, memory_capacity="6GiB", config=config) as cluster, \
            tc.connect(cluster.address) as local, tc.connect(cluster.address, config=remote_cfg) as remote:
        for size in sizes:
            n = count(size, reps)
            data = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
            dst = np.ones_like(data)
            counter = iter(range(1 << 30))
            t_copy = times(lambda: np.copyto(dst, data), n)  # noqa: B023
            _quiet(cluster)
            for _ in range(warm_puts(cluster, size)):  # untimed: as in service, the client has written the stock before
                local.delete(local.put(fresh(data, next(counter))).id)
            gs0 = gs_commits(cluster)
            t_put = times(lambda: local.put(fresh(data, next(counter))), n, lambda a: local.delete(a.id))  # noqa: B023
            gs1 = gs_commits(cluster)
            t_put_remote = times(lambda: remote.put(fresh(data, next(counter))), n,  # noqa: B023
                                 lambda a: remote.delete(a.id))
            art = local.put(data)
            t_get = times(lambda: art.tensor(like="numpy"), max(n, GET_REPS))  # noqa: B023
            t_get_remote = times(lambda: remote.artifact(art.id).tensor(like="numpy"), n)  # noqa: B023
            got = art.tensor(like="numpy")
            assert np.array_equal(got[:: max(1, size // 4096)], data[:: max(1, size // 4096)])
            local.delete(art.id)
            rows.append(_row(size, t_copy, t_put, t_put_remote, t_get, t_get_remote))
            rows[-1]["gs_commit_s"] = (gs1[0] - gs0[0]) / max(gs1[1] - gs0[1], 1)
    return rows


def _row(size: int, t_copy: list[float], t_put: list[float], t_put_remote: list[float], t_get: list[float],
         t_get_remote: list[float]) -> dict[str, float]:
    med = statistics.median
    copy, put, put_remote, get, get_remote = (med(t) for t in (t_copy, t_put, t_put_remote, t_get, t_get_remote))
    return {
        "size": size, "memcpy_s": copy, "put_local_s": put, "put_remote_s": put_remote,
        "get_local_s": get, "get_remote_s": get_remote,
        "put_local_best_s": min(t_put), "get_local_best_s": min(t_get), "memcpy_best_s": min(t_copy),
        "memcpy_GBps": size / copy / 1e9, "put_local_GBps": size / put / 1e9,
        "put_remote_GBps": size / put_remote / 1e9, "get_remote_GBps": size / get_remote / 1e9,
        "put_local_vs_memcpy": copy / put, "get_remote_vs_memcpy": copy / get_remote,
    }


def measure_many_small(metrics_on: bool = True, reps: int = 3, overrides: dict[str, str] | None = None,
                       n_small: int = SMALL_COUNT) -> dict[str, float]:
    """One artifact of ``n_small`` tensors of ``SMALL`` bytes: put (tensors/s) and tensor_dict."""
    rng = np.random.default_rng(0)
    config = {**metrics_switch(metrics_on), **(overrides or {})}
    with tc.LocalCluster(workers=1, memory_capacity="6GiB", config=config) as cluster, \
            tc.connect(cluster.address) as client:
        _quiet(cluster)
        sets = [{f"t{i}": rng.integers(0, 255, SMALL, dtype=np.uint8) for i in range(n_small)} for _ in range(reps)]
        puts = iter(sets)
        arts: list[Any] = []
        t_put = times(lambda: client.put(next(puts)), reps, arts.append)
        t_get = times(lambda: arts[-1].tensor_dict(like="numpy"), reps)
        got = arts[-1].tensor_dict(like="numpy")
        assert all(np.array_equal(got[k], v) for k, v in list(sets[-1].items())[:100])
        for a in arts:
            client.delete(a.id)
    return {"tensors": n_small, "tensor_bytes": SMALL, "put_s": statistics.median(t_put),
            "put_tensors_per_s": n_small / statistics.median(t_put), "tensor_dict_s": statistics.median(t_get)}


def measure_ray(sizes: list[int], reps: int = 5, n_small: int = SMALL_COUNT) -> dict[str, Any] | None:
    """``ray.put`` / ``ray.get`` of the same arrays, and ``n_small`` puts of ``SMALL`` bytes one by one; None when
    Ray is not installed."""
    try:
        import ray
    except ImportError:
        return None
    ray.init(num_cpus=1, include_dashboard=False, logging_level="error", object_store_memory=2 << 30)
    try:
        rows = []
        for size in sizes:
            n = count(size, reps)
            data = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
            refs: list[Any] = [ray.put(data)]  # untimed, like TensorCast's first put of each size
            t_put = times(lambda: ray.put(data), n, refs.append)  # noqa: B023
            t_get = times(lambda: ray.get(refs[-1]), max(n, GET_REPS))  # noqa: B023
            refs.clear()
            rows.append({"size": size, "put_s": statistics.median(t_put), "get_s": statistics.median(t_get),
                         "put_best_s": min(t_put), "get_best_s": min(t_get)})
        small = np.ones(SMALL, np.uint8)
        t0 = time.perf_counter()
        many = [ray.put(small) for _ in range(n_small)]
        rate = n_small / (time.perf_counter() - t0)
        del many
        return {"version": ray.__version__, "rows": rows, "small_puts_per_s": rate}
    finally:
        ray.shutdown()


def show(rows: list[dict[str, float]], ray: dict[str, Any] | None, small: dict[str, float]) -> None:
    """The table, with each TensorCast row's ratios to memcpy and Ray (added to ``rows``)."""
    by_size = {r["size"]: r for r in ray["rows"]} if ray else {}
    table = Table(("size", ">8"), ("memcpy GB/s", ">11.2f"), ("put ms", ">7.3f"), ("put GB/s", ">9.2f"),
                  ("x memcpy", ">8.2f"), ("gs ms", ">6.2f"), ("ray put ms", ">10.3f"), ("x ray", ">6.2f"),
                  ("put tcp", ">8.2f"), ("get ms", ">7.3f"), ("ray.get ms", ">10.3f"), ("x ray", ">6.2f"),
                  ("get tcp GB/s", ">12.2f"))
    table.header()
    for r in rows:
        rr = by_size.get(r["size"])
        if rr:
            r["ray_put_GBps"] = r["size"] / rr["put_s"] / 1e9
            r["put_local_vs_ray"] = rr["put_s"] / r["put_local_s"]
            r["get_local_vs_ray"] = rr["get_s"] / r["get_local_s"]
        table.row(fmt_size(int(r["size"])), r["memcpy_GBps"], r["put_local_s"] * 1e3, r["put_local_GBps"],
                  r["put_local_vs_memcpy"], r.get("gs_commit_s", 0) * 1e3, rr["put_s"] * 1e3 if rr else None,
                  r.get("put_local_vs_ray"), r["put_remote_GBps"], r["get_local_s"] * 1e3,
                  rr["get_s"] * 1e3 if rr else None, r.get("get_local_vs_ray"), r["get_remote_GBps"])
    first, last = rows[0], rows[-1]
    print(f"\nsame-host tensor(): {first['get_local_s'] * 1e3:.3f} ms at {fmt_size(int(first['size']))}, "
          f"{last['get_local_s'] * 1e3:.3f} ms at {fmt_size(int(last['size']))} (mapped, not copied)")
    line = (f"{small['tensors']:.0f} tensors of {fmt_size(SMALL)} in one artifact: put "
            f"{small['put_tensors_per_s']:,.0f} tensors/s, tensor_dict {small['tensor_dict_s'] * 1e3:.1f} ms")
    if ray:
        small["vs_ray_puts"] = small["put_tensors_per_s"] / ray["small_puts_per_s"]
        line += f"; ray.put one by one {ray['small_puts_per_s']:,.0f}/s (x{small['vs_ray_puts']:.1f})"
    print(line)
    if not ray:
        print("ray: not installed, no Ray columns (pip install .[bench])")


def _read_one(client: Any, artifact_id: str) -> Any:
    return client.artifact(artifact_id).tensor(like="numpy")


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def measure_tls(sizes: list[int], reps: int) -> list[dict[str, float]]:
    """Put and get over TLS against plain text, per size and path, the two clusters' calls interleaved."""
    rows = []
    paths = ("put_local", "get_local", "put_remote", "get_remote")
    with tlslib.pair(workers=1, memory_capacity="4GiB", config={"worker.prefault_bytes": "256MiB"}) as clusters:
        clients = {name: {"local": tlslib.connect(c), "remote": tlslib.connect(c, **{"client.host_id": "far"})}
                   for name, c in clusters.items()}
        try:
            for size in sizes:
                data = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
                kept = {name: c["local"].put(data) for name, c in clients.items()}
                got: dict[tuple[str, str], list[float]] = {(n, p): [] for n in clients for p in paths}
                counter = iter(range(1, 1 << 30))
                for i in range(count(size, reps) + 1):
                    for name, c in clients.items():
                        for where, client in c.items():
                            new = fresh(data, next(counter))  # new content: nothing deduplicated
                            t_put, art = _timed(functools.partial(client.put, new))
                            client.delete(art.id)
                            t_get, _ = _timed(functools.partial(_read_one, client, kept[name].id))
                            if i:  # the first: connections opened, mappings made
                                got[(name, f"put_{where}")].append(t_put)
                                got[(name, f"get_{where}")].append(t_get)
                for name, c in clients.items():
                    c["local"].delete(kept[name].id)
                row: dict[str, float] = {"size": size}
                for p in paths:
                    plain, tls = (statistics.median(got[(n, p)]) for n in ("plain", "tls"))
                    row[f"{p}_plain_s"], row[f"{p}_tls_s"], row[f"{p}_ratio"] = plain, tls, plain / tls
                rows.append(row)
        finally:
            for pair in clients.values():
                for client in pair.values():
                    client.close()
    table = Table(("size", ">8"), *((f"{p} plain/TLS", ">20.2f") for p in paths))
    table.header()
    for r in rows:
        table.row(fmt_size(int(r["size"])), *(r[f"{p}_ratio"] for p in paths))
    return rows


def main() -> None:
    ap = parser(__doc__, "fewer sizes and repetitions, about a minute")
    ap.add_argument("--tls", action="store_true", help="TLS against plain text, and what opening a connection "
                    "costs, instead of the default comparison")
    ap.add_argument("--metrics", choices=["on", "off"], default="on", help="metrics recording (default on)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="cluster configuration, e.g. gs.sqlite_synchronous=NORMAL (repeatable)")
    args = parse_args(ap)
    overrides = {**(SMOKE_CONFIG if args.smoke else {}), **dict(kv.split("=", 1) for kv in args.set)}
    if args.tls:
        tls_rows = measure_tls(pick(args, [4 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20],
                                    [4 << 10, 1 << 20, 16 << 20], [4 << 10, 1 << 20]), pick(args, 9, 5, 1))
        write_json(args.json, "put_get-tls", args.quick, rows=tls_rows,
                   handshakes=tlslib.handshakes(pick(args, 100, 20, 3)))
        return

    sizes = pick(args, [4 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20], [4 << 10, 1 << 20, 16 << 20, 64 << 20],
                 [4 << 10, 1 << 20])
    reps = pick(args, 9, 5, 1)
    small_count = pick(args, SMALL_COUNT, SMALL_COUNT, 200)
    # TensorCast first, Ray after: on a VM whose freed memory goes back to the hypervisor, whatever runs after
    # another system's shutdown touches cold memory for a while (measured: 2-3x slower large puts).
    rows = measure(sizes, args.metrics == "on", reps, overrides)
    small = measure_many_small(args.metrics == "on", pick(args, 3, 3, 1), overrides, small_count)
    ray = measure_ray(sizes, reps, small_count)
    show(rows, ray, small)
    print(shm_pages())
    write_json(args.json, "put_get", args.quick, metrics=args.metrics, config=overrides, rows=rows, many_small=small,
               ray=ray or {"skipped": "ray is not installed (pip install .[bench])"})


if __name__ == "__main__":
    main()
