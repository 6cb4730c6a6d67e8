"""Worker-to-worker transfers against a raw Python socket, same-host tensor() and TP views.

Measured in one run:
1. latency of small transfers (64 KiB, 1 MiB): back-to-back ``evict`` + ``prefetch`` (worker w0 -> worker
   w1, two simulated hosts), p50/p99 of the whole call (the caller's view: RPC to the destination, the
   global-store lookup, the transfer, recording the replica) and of the transfer alone (as the destination
   timed it); baseline: a raw socket request/response of the same size on a kept connection.
2. sustained throughput, 1/2/4 streams, sizes 16 MiB..4 GiB: the same back-to-back loop with no idle time
   between transfers (so no time for the destination to pre-fault memory: it runs on what it recycles);
   baseline: a raw socket stream between two processes, ``sendall`` from a touched buffer and ``recv_into``
   a touched buffer, same stream counts. Ratio = median ours / median raw.
3. a tensor-parallel view (rank 0 of 4, dim 0 and dim 1) read from another host vs reading the whole tensor
   and slicing it locally.
4. same-host ``tensor()`` of 64 MiB..(4 GiB): must stay flat (mapped, not copied); best of 5 lookups and reads,
   and the median first read (a lookup and ``tensor()`` by a caller that never read it: the lookup answered by
   the caller's gateway under the read lease an earlier lookup took, ``gs.read_leases``), sent on the caller's
   thread (``client.thread_calls``) and, as the baseline, through the client's event loop.

With ``--tls``, instead: what TLS costs on the data plane, against the plain-text path in the same run. Two
clusters alike but for TLS (both with a token): prefetch w0 -> w1 of 1 MiB..1 GiB, 1 and 4 streams, the two
clusters' transfers interleaved; ratio = median plain / median TLS (1: free); then the price of opening a
connection (``tlslib.handshakes``): without a token, with the challenge-response, with TLS too.

With ``--netns`` (needs root and iproute2), instead: between real hosts, each in its own network namespace
(no shared memory, a veth pair and a bridge between them), prefetch w0 -> w1 of 16 MiB..1 GiB, 1 and 4
streams, against a raw Python socket stream (``sendall`` from a touched buffer, ``recv_into`` a touched
buffer, same stream counts) between the same two namespaces. Ratio = median ours / median raw, in GB/s.

``--smoke``: 64 KiB and 1 MiB latency (10 calls), 16 MiB sustained, the 64 MiB TP view, 64 MiB same-host, one
repetition; ``--tls --smoke``: 1 and 16 MiB; ``--netns --smoke``: 4 MiB (figures meaningless; every row).

Usage: python benchmarks/transfer.py [--quick | --smoke] [--tls] [--netns] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import tensorcast as tc
import tlslib
from benchlib import Table, best_of, fmt_size, parse_args, parser, pct, pick, recv_exactly, write_json
from tensorcast.netns import Hosts, netns_available

MiB = 1 << 20
# argv: size, streams[, bind address, port]; prints the port it listens on.
_RAW_SENDER = r"""
import socket, sys, threading, numpy as np
size, streams = int(sys.argv[1]), int(sys.argv[2])
bind = (sys.argv[3], int(sys.argv[4])) if len(sys.argv) > 4 else ("127.0.0.1", 0)
buf = np.ones(size, np.uint8)
srv = socket.create_server(bind); print(srv.getsockname()[1], flush=True)
def serve(c):
    lo, hi = (int(x) for x in c.recv(64).decode().split())
    c.sendall(memoryview(buf)[lo:hi]); c.close()
while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


def raw_receive(addr: str, port: int, dest: np.ndarray[Any, Any], streams: int) -> float:
    """Seconds to receive ``dest`` from a raw sender at ``addr:port`` (``_RAW_SENDER``) over ``streams``
    connections, each asking for its range and receiving it into a touched buffer."""
    size = len(dest)
    per = -(-size // streams)

    def one(lo: int, hi: int) -> None:
        with socket.create_connection((addr, port)) as s:
            s.sendall(f"{lo} {hi}".encode().ljust(64))
            recv_exactly(s, memoryview(dest.data)[lo:hi])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(lo, min(lo + per, size))) for lo in range(0, size, per)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


class RawStream:
    """A sender process serving ranges of a touched buffer; the receiver ``recv_into`` a touched buffer."""

    def __init__(self, size: int, streams: int) -> None:
        self.size = size
        self.streams = streams
        self.proc = subprocess.Popen([sys.executable, "-c", _RAW_SENDER, str(size), str(streams)],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())
        self.dest = np.ones(size, np.uint8)

    def run(self) -> float:
        return raw_receive("127.0.0.1", self.port, self.dest, self.streams)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


_RAW_ECHO = r"""
import socket, sys, numpy as np
size = int(sys.argv[1])
buf = np.ones(size, np.uint8)
srv = socket.create_server(("127.0.0.1", 0)); print(srv.getsockname()[1], flush=True)
c, _ = srv.accept()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while c.recv(64):
    c.sendall(buf)
"""


def raw_latencies(size: int, n: int) -> list[float]:
    """Seconds of a request/response of ``size`` bytes on a kept connection, ``n`` times."""
    proc = subprocess.Popen([sys.executable, "-c", _RAW_ECHO, str(size)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        sock = socket.create_connection(("127.0.0.1", int(proc.stdout.readline())))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        view = memoryview(np.ones(size, np.uint8).data)
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            sock.sendall(b"x")
            recv_exactly(sock, view)
            out.append(time.perf_counter() - t0)
        sock.close()
        return out
    finally:
        proc.kill()
        proc.wait()


def bench_latency(client: tc.Client, sizes: list[int], n: int) -> list[dict[str, float]]:
    table = Table(("size", ">8"), ("call p50 ms", ">12.2f"), ("call p99", ">9.2f"), ("transfer p50", ">13.2f"),
                  ("transfer p99", ">13.2f"), ("raw p50", ">8.2f"), ("raw p99", ">8.2f"))
    table.header()
    rows = []
    for size in sizes:
        art = client.put(np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8), on="w0")
        calls, moves = [], []
        for i in range(n + 5):
            art.evict(on="w1")
            t0 = time.perf_counter()
            done = art.prefetch(to="w1").result(timeout=60)
            if i >= 5:  # the first ones open connections
                calls.append(time.perf_counter() - t0)
                moves.append(done.seconds)
        raw = raw_latencies(size, n)
        row = {"size": size, "n": n, "call_p50_ms": pct(calls, 50) * 1e3, "call_p99_ms": pct(calls, 99) * 1e3,
               "transfer_p50_ms": pct(moves, 50) * 1e3, "transfer_p99_ms": pct(moves, 99) * 1e3,
               "raw_p50_ms": pct(raw, 50) * 1e3, "raw_p99_ms": pct(raw, 99) * 1e3}
        rows.append(row)
        table.row(fmt_size(size), *(row[k] for k in ("call_p50_ms", "call_p99_ms", "transfer_p50_ms",
                                                      "transfer_p99_ms", "raw_p50_ms", "raw_p99_ms")))
        client.delete(art.id)
    return rows


def bench_sustained(client: tc.Client, sizes: list[int], reps: int) -> list[dict[str, float]]:
    print()
    table = _throughput_table(("size", ">8"))
    rows = []
    for size in sizes:
        art = client.put(np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8), on="w0")
        for streams in (1, 2, 4):
            raw = RawStream(size, streams)
            try:
                t_raw = float(np.median([raw.run() for _ in range(reps)]))
            finally:
                raw.close()
            times = []
            for _ in range(reps + 1):  # back to back: no idle time for the destination to pre-fault
                art.evict(on="w1")
                t0 = time.perf_counter()
                art.prefetch(to="w1", streams=streams).result(timeout=600)
                times.append(time.perf_counter() - t0)
            times = times[1:]  # the first: the sender computes (and caches) its chunk checksums
            t_ours = float(np.median(times))
            row = {"size": size, "streams": streams, "raw_GBps": size / t_raw / 1e9, "ours_GBps": size / t_ours / 1e9,
                   "ours_min_GBps": size / max(times) / 1e9, "ours_max_GBps": size / min(times) / 1e9,
                   "ratio": t_raw / t_ours}
            rows.append(row)
            _throughput_row(table, fmt_size(size), streams, row)
        client.delete(art.id)
    return rows


def _throughput_table(first: tuple[str, str]) -> Table:
    table = Table(first, ("streams", ">7"), ("raw GB/s", ">9.2f"), ("ours GB/s", ">10.2f"), ("min-max", ">11"),
                  ("ours/raw", ">9.2f"))
    table.header()
    return table


def _throughput_row(table: Table, label: str, streams: int, row: dict[str, float]) -> None:
    table.row(label, streams, row["raw_GBps"], row["ours_GBps"],
              f"{row['ours_min_GBps']:>5.2f}-{row['ours_max_GBps']:<5.2f}", row["ratio"])


# The receiver of the same raw stream as RawStream (whose sender runs in the source host's namespace), in a
# namespace of its own: ``raw_receive``, from this file. A fixed port is free: each namespace has a network stack
# of its own.
_NETNS_PORT = 47000
_RAW_NETNS_RECEIVER = r"""
import sys
sys.path.insert(0, sys.argv[6])
import numpy as np
from transfer import raw_receive
addr, port, size, streams, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
buf = np.ones(size, np.uint8)
times = sorted(raw_receive(addr, port, buf, streams) for _ in range(reps))
print(times[len(times) // 2])
"""


def raw_netns(net: Hosts, src: int, dst: int, size: int, streams: int, reps: int) -> float:
    """Median seconds to move ``size`` bytes from host ``src`` to host ``dst`` over ``streams`` raw sockets."""
    addr, port = net.address(src), str(_NETNS_PORT)
    sender = subprocess.Popen([*net.exec_args(src), sys.executable, "-c", _RAW_SENDER, str(size), str(streams),
                               addr, port], stdout=subprocess.PIPE, text=True)
    try:
        assert sender.stdout is not None and sender.stdout.readline().strip() == port
        recv = subprocess.run([*net.exec_args(dst), sys.executable, "-c", _RAW_NETNS_RECEIVER, addr, port,
                               str(size), str(streams), str(reps), str(Path(__file__).parent)],
                              capture_output=True, text=True, check=True, timeout=600)
        return float(recv.stdout.strip())
    finally:
        sender.kill()
        sender.wait()


def bench_netns(sizes: list[int], reps: int) -> list[dict[str, float]]:
    """Worker-to-worker prefetch between two namespaced hosts vs a raw socket between the same namespaces,
    with the same stream counts."""
    table = _throughput_table(("between namespaced hosts", "<24"))
    rows = []
    with tc.LocalCluster(workers=2, hosts=2, netns=True, memory_capacity=f"{2 * max(sizes) + (1 << 30)}") \
            as cluster, tc.connect(cluster.address, cluster.token) as c:
        net = cluster.net
        assert net is not None
        src, dst = cluster.host_of("w0"), cluster.host_of("w1")
        for size in sizes:
            art = c.put({"t": np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)}, on="w0")
            for streams in (1, 4):
                t_raw = raw_netns(net, src, dst, size, streams, reps)
                times = []
                for _ in range(reps + 1):
                    with contextlib.suppress(tc.errors.TensorCastError):
                        art.evict(on="w1")
                    t0 = time.perf_counter()
                    art.prefetch(to="w1", streams=streams).result(timeout=600)
                    times.append(time.perf_counter() - t0)
                times = times[1:]  # the first: the sender computes (and caches) its chunk checksums
                t_ours = float(np.median(times))
                row = {"size": size, "streams": streams, "reps": reps, "raw_GBps": size / t_raw / 1e9,
                       "ours_GBps": size / t_ours / 1e9, "ours_min_GBps": size / max(times) / 1e9,
                       "ours_max_GBps": size / min(times) / 1e9, "ratio": t_raw / t_ours}
                rows.append(row)
                _throughput_row(table, fmt_size(size), streams, row)
            c.delete(art.id)
    return rows


def main_netns(args: argparse.Namespace) -> None:
    if not netns_available():
        raise SystemExit(f"--netns needs root and iproute2 to create network namespaces (uid {os.geteuid()})")
    sizes = pick(args, [16 * MiB, 64 * MiB, 256 * MiB, 1 << 30], [16 * MiB, 64 * MiB, 256 * MiB], [4 * MiB])
    rows = bench_netns(sizes, pick(args, 5, 3, 1))
    ratios = [r["ratio"] for r in rows]
    print(f"\nbetween namespaced hosts: ours/raw min {min(ratios):.2f}, median {float(np.median(ratios)):.2f}")
    write_json(args.json, "transfer-netns", args.quick, netns_transfer=rows)


def _prefetch_seconds(client: tc.Client, art: tc.Artifact, streams: int) -> float:
    art.evict(on="w1")
    t0 = time.perf_counter()
    client.artifact(art.id).prefetch(to="w1", streams=streams).result(timeout=600)
    return time.perf_counter() - t0


def main_tls(args: argparse.Namespace) -> None:
    """Worker-to-worker prefetch over TLS against plain text, the two clusters' runs interleaved."""
    sizes = pick(args, [MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1 << 30], [MiB, 16 * MiB, 64 * MiB], [MiB, 16 * MiB])
    reps = pick(args, 9, 5, 1)
    rows = []
    table = Table(("size", ">8"), ("streams", ">7"), ("plain GB/s", ">11.2f"), ("TLS GB/s", ">9.2f"),
                  ("plain/TLS time", ">15.2f"))
    table.header()
    with tlslib.pair(workers=2, hosts=2, memory_capacity=f"{2 * max(sizes) + (1 << 30)}",
                     config={"worker.prefault_bytes": "256MiB"}) as clusters:
        clients = {name: tlslib.connect(c) for name, c in clusters.items()}
        try:
            for size in sizes:
                data = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
                arts = {name: c.put({"t": data}, on="w0") for name, c in clients.items()}
                for streams in (1, 4):
                    got: dict[str, list[float]] = {name: [] for name in clients}
                    for i in range(reps + 1):
                        for name, c in clients.items():
                            t = _prefetch_seconds(c, arts[name], streams)
                            if i:  # the first: connections opened, chunk checksums computed and cached
                                got[name].append(t)
                    plain, tls = (float(np.median(got[k])) for k in ("plain", "tls"))
                    row = {"size": size, "streams": streams, "plain_GBps": size / plain / 1e9,
                           "tls_GBps": size / tls / 1e9, "ratio": plain / tls}
                    rows.append(row)
                    table.row(fmt_size(size), streams, row["plain_GBps"], row["tls_GBps"], row["ratio"])
                for name, c in clients.items():
                    c.delete(arts[name].id)
        finally:
            for c in clients.values():
                c.close()
    shakes = tlslib.handshakes(pick(args, 100, 20, 3))
    big = [r["ratio"] for r in rows if r["size"] >= 16 * MiB]
    print(f"\nTLS on the data plane, >= 16 MiB: plain/TLS time min {min(big):.2f}, median {float(np.median(big)):.2f}")
    write_json(args.json, "transfer-tls", args.quick, tls_transfer=rows, handshakes=shakes)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--tls", action="store_true", help="TLS against plain text on the data plane, and what "
                    "opening a connection costs, instead of the default sections")
    ap.add_argument("--netns", action="store_true", help="between hosts in network namespaces (root): "
                    "prefetch vs a raw socket between the same namespaces, instead of the default sections")
    args = parse_args(ap)
    if args.tls:
        main_tls(args)
        return
    if args.netns:
        main_netns(args)
        return
    sizes = pick(args, [16 * MiB, 64 * MiB, 256 * MiB, 1 << 30, 4 << 30], [16 * MiB, 64 * MiB, 256 * MiB], [16 * MiB])
    map_sizes = pick(args, [64 * MiB, 256 * MiB, 1 << 30, 4 << 30, 8 << 30], [64 * MiB, 256 * MiB, 1 << 30],
                     [64 * MiB])
    reps = pick(args, 5, 3, 1)
    results: dict[str, list[dict[str, float]]] = {"latency": [], "transfer": [], "same_host_tensor": [], "tp_view": []}
    far = tc.Config.from_flat({"client.host_id": "bench-far"})
    with tc.LocalCluster(workers=2, hosts=2, memory_capacity="12GiB",
                         config={"worker.prefault_bytes": pick(args, "1GiB", "1GiB", "64MiB")}) \
            as cluster, tc.connect(cluster.address) as client, tc.connect(cluster.address, config=far) as remote:
        results["latency"] = bench_latency(client, [64 * 1024, MiB], pick(args, 300, 100, 10))
        results["transfer"] = bench_sustained(client, sizes, reps)

        # ---------------------------------------------------------- 3. TP view vs whole + slice
        w = np.random.default_rng(9).standard_normal((4096, 4096)).astype(np.float32)  # 64 MiB
        art = client.put({"w": w}, on="w0")
        print()
        table = Table(("read (other host), 64 MiB fp32", "<36"), ("ms", ">8.1f"), ("vs whole", ">9"))
        table.header()
        t_whole = best_of(lambda: remote.artifact(art.id).tensor("w", like="numpy")[:1024], reps)
        for dim in (0, 1):
            def view(dim: int = dim) -> Any:
                return remote.artifact(art.id).view(tp=tc.TP(0, 4), rules={"w": dim}).tensor("w", like="numpy")

            got = view()
            want = w[:1024] if dim == 0 else w[:, :1024]
            assert np.array_equal(got, want)
            t_view = best_of(view, reps)
            results["tp_view"].append({"dim": dim, "view_s": t_view, "whole_s": t_whole,
                                       "speedup": t_whole / t_view})
            table.row(f"TP rank 0/4 split dim {dim}", t_view * 1e3, f"{t_whole / t_view:.2f}x")
        table.row("whole tensor then slice", t_whole * 1e3, f"{1.0:.2f}x")

    # ---------------------------------------------------------- 4. same-host tensor() (its own cluster: no stock)
    loop_only = tc.Config.from_flat({"client.thread_lookups": False})
    with tc.LocalCluster(workers=1, memory_capacity=f"{max(map_sizes) + (1 << 30)}",
                         config={"worker.prefault_bytes": 0}) as cluster, tc.connect(cluster.address) as client, \
            tc.connect(cluster.address, config=loop_only) as via_loop:
        print()
        table = Table(("size", ">8"), ("tensor() ms", ">12.3f"), ("first read ms", ">14.3f"),
                      ("via loop ms", ">12.3f"), ("speedup", ">8"))
        table.header()
        for size in map_sizes:
            data = np.zeros(size, np.uint8)
            art = client.put(data)
            del data  # the caller's copy is gone before the reads
            t = best_of(lambda: client.artifact(art.id).tensor(like="numpy"), 5)  # noqa: B023

            def first_read(c: tc.Client, art: tc.Artifact = art) -> float:
                """A read by a caller that never read it: its lookup, then tensor() (the places kept from
                earlier reads forgotten; the bytes were checked by the reads above, once)."""
                c.aio.reader.kept.forget(art.id)
                t0 = time.perf_counter()
                c.artifact(art.id).tensor(like="numpy")
                return time.perf_counter() - t0

            first_read(via_loop)
            pairs = [(first_read(client), first_read(via_loop)) for _ in range(21)]  # interleaved: same noise
            first, loop = (float(np.median(x)) for x in zip(*pairs, strict=True))
            results["same_host_tensor"].append({"size": size, "seconds": t, "first_read_s": first,
                                                "first_read_via_loop_s": loop})
            table.row(fmt_size(size), t * 1e3, first * 1e3, loop * 1e3, f"{loop / first:.2f}x")
            client.delete(art.id)

    big = [r for r in results["transfer"] if r["size"] >= 64 * MiB]
    if big:
        print(f"\nsustained, at >= 64 MiB: ours/raw min {min(r['ratio'] for r in big):.2f}, "
              f"median {float(np.median([r['ratio'] for r in big])):.2f} (goal >= 0.8)")
    for r in results["latency"]:
        print(f"{fmt_size(int(r['size']))} transfers: p99 {r['call_p99_ms']:.2f} ms per call, "
              f"{r['transfer_p99_ms']:.2f} ms moving the bytes (goal: 1 MiB <= 5 ms)")
    m = results["same_host_tensor"]
    print(f"same-host tensor(): {m[0]['seconds'] * 1e3:.3f} ms at {fmt_size(int(m[0]['size']))}, "
          f"{m[-1]['seconds'] * 1e3:.3f} ms at {fmt_size(int(m[-1]['size']))}; first read (median) "
          f"{max(r['first_read_s'] for r in m) * 1e3:.3f} ms at most (goal <= 0.2 ms)")
    write_json(args.json, "transfer", args.quick, **results)


if __name__ == "__main__":
    main()
