"""Distributed Checkpoint into TensorCast against DCP's FileSystemWriter on local disk, in one run.

W spawned ranks (gloo, CPU) hold a model + Adam-like state (three float32 tensors per parameter, DTensors
sharded on dim 0) of ``--mib`` MiB in all. Each row is the slowest rank's time (all-reduced MAX):
- memcpy: a clone of each rank's local bytes (the limit of any stall);
- stall: the time ``dcp.save`` (sync) or ``dcp.async_save`` (until it returns) blocks training, with
  ``TensorCastWriter`` (memory replicas first, disk copy in the background) and ``FileSystemWriter``;
- durable: TensorCast's disk copies written (``wait_durable``), from the start of the sync save;
- load / reshard-load: ``dcp.load`` into the same layout, and into dim-1 shards, from TensorCast and from the
  files with a warm page cache;
- cold load: the same from the files with their pages dropped from the page cache (``POSIX_FADV_DONTNEED``
  after ``fsync``, which needs no root), against TensorCast's load from memory;
- recovery: after SIGKILL of a worker holding one of the two memory replicas (a lost host), ``dcp.load`` from
  the surviving replica, against the cold load from the files (what a job without peer copies reads).
Ratios: FileSystemWriter time / TensorCast time (above 1: TensorCast is faster), and stall / memcpy.

``--smoke``: 8 MiB over 2 ranks (figures meaningless; every row).

Usage: python benchmarks/checkpoint.py [--quick | --smoke] [--json PATH] [--mib N] [--ranks 2,4]
"""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import tensorcast as tc
from benchlib import Table, free_port, parse_args, parser, pick, write_json
from tensorcast.integrations.torch_dcp import TensorCastReader, TensorCastWriter


def _state(mesh: Any, mib: int, dim: int, fill: bool) -> dict[str, Any]:
    world, rank = mesh.size(), mesh.get_local_rank()
    rows = max(world * 4, (mib << 20) // (4 * 1024 * 3 * 8))  # 8 parameters, 3 tensors each, 1024 columns
    rows -= rows % world  # equal local shards (DTensor's uneven split is its own layout)
    out: dict[str, Any] = {}
    for i in range(8):
        for part in ("param", "exp_avg", "exp_avg_sq"):
            full_shape = (rows, 1024)
            local_shape = list(full_shape)
            local_shape[dim] //= world
            local = torch.full(local_shape, float(i + rank) if fill else 0.0)
            out[f"{part}.{i}"] = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False,
                                                    shape=torch.Size(full_shape), stride=(1024, 1))
    out["step"] = 1200
    return out


def _timed(fn: Any) -> float:
    dist.barrier()
    t = time.perf_counter()
    fn()
    dt = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt.item())


def _drop_page_cache(root: str) -> None:
    """Evict the files' pages from the page cache (clean pages: written back first), as a cold start sees."""
    for folder, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _cold(rank: int, root: str) -> None:
    if rank == 0:
        _drop_page_cache(root)
    dist.barrier()


def _rank(rank: int, world: int, port: int, address: str, mib: int, root: str, out: Any, killed: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    # async_save runs its collectives on a background thread: on the default group they would interleave
    # with the timing barriers of the main thread (a hang), so the async saves get a group of their own.
    async_group = dist.new_group(backend="gloo")
    sd = _state(mesh, mib, 0, True)
    r: dict[str, float] = {}
    with tc.connect(address) as client:
        r["memcpy"] = _timed(lambda: [v.to_local().clone() for v in sd.values() if isinstance(v, DTensor)])
        r["fs_sync_stall"] = _timed(lambda: dcp.save(sd, storage_writer=dcp.FileSystemWriter(f"{root}/fs1")))
        r["fs_async_stall"] = _timed(lambda: setattr(_timed, "f", dcp.async_save(
            sd, storage_writer=dcp.FileSystemWriter(f"{root}/fs2"), process_group=async_group)))
        _timed.f.result()  # type: ignore[attr-defined]
        writer = TensorCastWriter(client, f"bench/w{world}/step-1")
        t0 = time.perf_counter()
        r["tc_sync_stall"] = _timed(lambda: dcp.save(sd, storage_writer=writer))
        writer.wait_durable()
        r["tc_durable"] = _timed(lambda: None) + time.perf_counter() - t0
        writer2 = TensorCastWriter(client, f"bench/w{world}/step-2")
        r["tc_async_stall"] = _timed(lambda: setattr(_timed, "g", dcp.async_save(
            sd, storage_writer=writer2, process_group=async_group)))
        _timed.g.result()  # type: ignore[attr-defined]
        writer2.wait_durable()
        for dim, name in ((0, "load"), (1, "reshard_load")):
            target = _state(mesh, mib, dim, False)
            r[f"tc_{name}"] = _timed(lambda t=target: dcp.load(
                t, storage_reader=TensorCastReader(client, f"bench/w{world}/step-1")))
            target = _state(mesh, mib, dim, False)
            r[f"fs_{name}"] = _timed(lambda t=target: dcp.load(t, storage_reader=dcp.FileSystemReader(f"{root}/fs1")))
        target = _state(mesh, mib, 0, False)
        _cold(rank, root)
        r["fs_cold_load"] = _timed(lambda: dcp.load(target, storage_reader=dcp.FileSystemReader(f"{root}/fs1")))
        if rank == 0:  # the parent kills a worker holding replicas, then says so
            out.put(("kill", None))
            killed.wait(120)
        dist.barrier()
        target = _state(mesh, mib, 0, False)
        r["tc_recovery"] = _timed(lambda: dcp.load(
            target, storage_reader=TensorCastReader(client, f"bench/w{world}/step-1")))
        if not all(bool((v.to_local() == float(int(k.split(".")[1]) + rank)).all())
                   for k, v in target.items() if isinstance(v, DTensor)):
            raise RuntimeError("recovered checkpoint differs from what was saved")
    if rank == 0:
        out.put(("result", r))
    dist.destroy_process_group()


def run(world: int, mib: int, cluster: tc.LocalCluster) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    out, killed = ctx.Queue(), ctx.Event()
    address, victim = cluster.address, ""
    root = tempfile.mkdtemp(prefix="dcp-bench-", dir=os.environ.get("BENCH_DISK_DIR", "."))
    try:
        procs = [ctx.Process(target=_rank, args=(r, world, port, address, mib, root, out, killed))
                 for port in [free_port()] for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 600
        while True:  # a rank that failed ends the run at once, not after the deadline
            try:
                what, result = out.get(timeout=1)
                if what == "result":
                    break
                victim = _lose_a_host(cluster)
                killed.set()
            except queue.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    for p in procs:
                        p.kill()
                    raise RuntimeError(f"a rank failed (exit codes {failed}) or the run passed 600 s") from None
        for p in procs:
            p.join(60)
        if victim:
            cluster.restart_worker(victim)  # empty, for the next row
        return dict(result)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _lose_a_host(cluster: tc.LocalCluster) -> str:
    """SIGKILL the worker that is not the gateway (it holds one of each rank's two memory replicas)."""
    with tc.connect(cluster.address) as client:
        gateway = {w.address: w.worker_id for w in client.list_workers()}[cluster.address]
        victim = next(w.worker_id for w in client.list_workers() if w.worker_id != gateway)
    cluster.kill_worker(victim)
    return victim


def main() -> None:
    ap = parser(__doc__, "64 MiB over 2 ranks, under a minute")
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--ranks", default="2,4")
    args = parse_args(ap)
    mib, ranks = pick(args, (args.mib, [int(x) for x in args.ranks.split(",")]), (64, [2]), (8, [2]))
    results: dict[str, dict[str, float]] = {}
    with tc.LocalCluster(workers=2, memory_capacity=f"{max(1, 3 * mib // 1024 + 1)}GiB") as cluster:
        for world in ranks:
            results[str(world)] = run(world, mib, cluster)
    table = Table(("ranks", ">5"), ("row", "<14"), ("TensorCast s", ">12.4f"), ("FileSystem s", ">12.4f"),
                  ("FS/TC", ">7.2f"), ("TC/memcpy", ">9.2f"))
    table.header()
    for ranks_run, r in results.items():
        for row, tc_key, fs_key in (("sync stall", "tc_sync_stall", "fs_sync_stall"),
                                    ("async stall", "tc_async_stall", "fs_async_stall"),
                                    ("load", "tc_load", "fs_load"),
                                    ("reshard-load", "tc_reshard_load", "fs_reshard_load"),
                                    ("cold load", "tc_load", "fs_cold_load"),
                                    ("recovery", "tc_recovery", "fs_cold_load")):
            table.row(ranks_run, row, r[tc_key], r[fs_key], r[fs_key] / r[tc_key], r[tc_key] / r["memcpy"])
        table.row(ranks_run, "memcpy", r["memcpy"], "", "", "")
        table.row(ranks_run, "durable (disk)", r["tc_durable"], "", "", "")
    write_json(args.json, "checkpoint", args.quick, mib=mib, results=results)


if __name__ == "__main__":
    main()
