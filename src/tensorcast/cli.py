"""The ``tensorcast`` command line: run processes (``up``, ``gs``, ``worker``) and use a cluster
(``status``, ``put``, ``get``, ``ls``, ``rm``).

Owns: flags, their mapping onto configuration keys, process entry points (signal handling, logging) and
human-readable output. Client commands find the cluster from ``--address``, ``TENSORCAST_ADDRESS`` or
``DATA_DIR/cluster.json``. Errors print one line and exit non-zero; no tracebacks for user mistakes.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import click
import numpy as np
from rich.console import Console
from rich.table import Table

from tensorcast.config import Config
from tensorcast.errors import InvalidArgument, TensorCastError

console = Console()
err_console = Console(stderr=True)


def _overrides(sets: tuple[str, ...], extra: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep:
            raise InvalidArgument(f"--set expects KEY=VALUE, got {item!r}")
        out[key.strip()] = value
    out.update({k: v for k, v in extra.items() if v is not None})
    return out


def _serve(name: str, coro_factory: Any) -> None:
    """Run a server coroutine until SIGTERM/SIGINT, then let it clean up."""
    from tensorcast.client.loop import new_event_loop
    from tensorcast.log import setup_logging

    setup_logging(name)
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        loop.run_until_complete(coro_factory(stop))
    finally:
        loop.close()


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except TensorCastError as exc:
            err_console.print(f"[red]error[/red] {exc}")
            sys.exit(2)


@click.group(cls=_Group)
@click.version_option(package_name="tensorcast")
def main() -> None:
    """TensorCast: a shared, programmable tensor pool for LLM infrastructure."""


_set_option = click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
                           help="Override a configuration key, e.g. worker.memory_capacity=2GiB.")
_config_option = click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
                              help="TOML configuration file.")


@main.command()
@click.option("--data-dir", type=click.Path(file_okay=False), required=True)
@click.option("--host", default=None, help="Bind address (loopback unless a token is configured).")
@click.option("--port", type=int, default=None)
@click.option("--ready-file", type=click.Path(dir_okay=False), default=None)
@_config_option
@_set_option
def gs(data_dir: str, host: str | None, port: int | None, ready_file: str | None, config_path: str | None,
       sets: tuple[str, ...]) -> None:
    """Run the global store (SQLite in DATA_DIR)."""
    from tensorcast.gs.service import run_global_store

    config = Config.load(config_path, _overrides(sets, {"gs.host": host, "gs.port": port}))
    _check_bind(config.gs.host, config.token)
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    _serve("gs", lambda stop: run_global_store(config, Path(data_dir), Path(ready_file) if ready_file else None,
                                               stop))


@main.command()
@click.option("--gs", "gs_address", required=True, help="Global store address HOST:PORT.")
@click.option("--id", "worker_id", required=True, help="Stable worker id (kept across restarts).")
@click.option("--host", default=None)
@click.option("--port", type=int, default=None)
@click.option("--roles", default=None, help="Comma-separated roles (default basic,gateway,shard-home).")
@click.option("--memory", default=None, help="Memory tier capacity, e.g. 8GiB.")
@click.option("--host-id", default=None, help="Host identity for same-host decisions.")
@click.option("--ready-file", type=click.Path(dir_okay=False), default=None)
@_config_option
@_set_option
def worker(gs_address: str, worker_id: str, host: str | None, port: int | None, roles: str | None,
           memory: str | None, host_id: str | None, ready_file: str | None, config_path: str | None,
           sets: tuple[str, ...]) -> None:
    """Run a worker."""
    from tensorcast.worker.server import run_worker

    config = Config.load(config_path, _overrides(sets, {
        "worker.host": host, "worker.port": port, "worker.roles": roles, "worker.memory_capacity": memory,
        "worker.host_id": host_id}))
    _check_bind(config.worker.host, config.token)
    _serve(f"worker-{worker_id}", lambda stop: run_worker(config, worker_id, gs_address,
                                                          Path(ready_file) if ready_file else None, stop))


def _check_bind(host: str, token: str | None) -> None:
    if token is None and host not in ("127.0.0.1", "localhost", "::1"):
        raise InvalidArgument(f"refusing to bind {host} without a cluster token: set TENSORCAST_TOKEN or "
                              "bind loopback")


@main.command()
@click.option("--workers", type=int, default=2, show_default=True)
@click.option("--hosts", type=int, default=1, show_default=True, help="Simulated hosts (network path).")
@click.option("--data-dir", type=click.Path(file_okay=False), default="./tc-data", show_default=True)
@click.option("--memory", default=None, help="Memory tier per worker, e.g. 4GiB.")
@_set_option
def up(workers: int, hosts: int, data_dir: str, memory: str | None, sets: tuple[str, ...]) -> None:
    """Start a local cluster (global store + workers) until Ctrl-C."""
    from tensorcast.cluster import LocalCluster

    cluster = LocalCluster(workers=workers, hosts=hosts, data_dir=data_dir, memory_capacity=memory,
                           config=_overrides(sets, {}), token=os.environ.get("TENSORCAST_TOKEN"))
    stop = False

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with cluster:
        console.print(f"TensorCast cluster up: gateway [bold]{cluster.address}[/bold], "
                      f"global store {cluster.gs_address}")
        console.print(f"wrote {Path(data_dir) / 'cluster.json'}; export TENSORCAST_ADDRESS={cluster.address}")
        console.print("Ctrl-C to stop.")
        while not stop:
            time.sleep(0.2)
        console.print("stopping...")


def _address(address: str | None, data_dir: str) -> str:
    if address:
        return address
    if os.environ.get("TENSORCAST_ADDRESS"):
        return os.environ["TENSORCAST_ADDRESS"]
    path = Path(data_dir) / "cluster.json"
    if path.exists():
        return str(json.loads(path.read_text())["address"])
    raise InvalidArgument(f"no cluster address: pass --address, set TENSORCAST_ADDRESS, or run `tensorcast up` "
                          f"with --data-dir {data_dir}")


_address_option = click.option("--address", default=None, help="Gateway HOST:PORT.")
_data_dir_option = click.option("--data-dir", default="./tc-data", show_default=True,
                                help="Where `tensorcast up` wrote cluster.json.")


def _client(address: str | None, data_dir: str) -> Any:
    from tensorcast.client.sync import connect

    return connect(_address(address, data_dir))


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


@main.command()
@click.option("--shards", "show_shards", is_flag=True, help="List every shard lease, not just a summary.")
@_address_option
@_data_dir_option
def status(show_shards: bool, address: str | None, data_dir: str) -> None:
    """Show the cluster's workers, instances and KV shard leases."""
    with _client(address, data_dir) as client:
        table = Table(title="workers")
        for col in ("id", "address", "host", "roles", "memory", "disk", "net in/out", "artifacts", "alive",
                    "last heartbeat"):
            table.add_column(col)
        now = time.time()
        for w in client.list_workers():
            table.add_row(w.worker_id, w.address, w.host_id, ",".join(w.roles),
                          f"{_size(w.memory_used)} / {_size(w.memory_capacity)}",
                          f"{_size(w.disk_used)} / {_size(w.disk_capacity)}" if w.disk_capacity else "-",
                          f"{_size(int(w.net_in_bps))}/s / {_size(int(w.net_out_bps))}/s", str(w.artifacts),
                          "yes" if w.alive else "[red]no[/red]", f"{now - w.last_heartbeat:.1f}s ago")
        console.print(table)
        instances = client.list_instances()
        if instances:
            itable = Table(title="instances")
            for col in ("id", "engine", "home worker", "running", "waiting", "KV tokens", "alive"):
                itable.add_column(col)
            for i in instances:
                itable.add_row(i.instance_id, i.engine, i.home_worker, str(i.running), str(i.waiting),
                               f"{i.kv_tokens_used} / {i.kv_tokens_capacity}", "yes" if i.alive else "[red]no[/red]")
            console.print(itable)
        shards = client.list_shards()
        stable = Table(title=f"KV shards ({shards.num_shards})")
        if show_shards:
            for col in ("shard", "holder", "fencing token", "lease age", "expires in"):
                stable.add_column(col)
            for lease in shards.leases:
                live = lease.holder and lease.expiry > shards.now
                stable.add_row(str(lease.shard), lease.holder or "-", str(lease.token),
                               f"{shards.now - lease.acquired_at:.1f}s" if live else "-",
                               f"{lease.expiry - shards.now:.1f}s" if live else "[red]expired[/red]")
        else:
            for col in ("holder", "shards", "oldest lease", "max fencing token"):
                stable.add_column(col)
            by_holder: dict[str, list[Any]] = {}
            for lease in shards.leases:
                live = lease.holder and lease.expiry > shards.now
                by_holder.setdefault(lease.holder if live else "(none)", []).append(lease)
            unleased = shards.num_shards - len(shards.leases)
            if unleased:
                by_holder.setdefault("(none)", [])
            for holder, leases in sorted(by_holder.items()):
                count = len(leases) + (unleased if holder == "(none)" else 0)
                age = max((shards.now - lease.acquired_at for lease in leases), default=0.0)
                token = max((lease.token for lease in leases), default=0)
                stable.add_row(holder, str(count), f"{age:.1f}s" if holder != "(none)" else "-", str(token))
        console.print(stable)


@main.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.argument("key")
@click.option("--ttl", type=float, default=None, help="Caller lease in seconds (default: system-owned).")
@_address_option
@_data_dir_option
def put(file: str, key: str, ttl: float | None, address: str | None, data_dir: str) -> None:
    """Store a .npy or .safetensors FILE under KEY."""
    tensors: Any
    if file.endswith(".npy"):
        tensors = np.load(file, allow_pickle=False)
    elif file.endswith(".safetensors"):
        try:
            from safetensors.numpy import load_file
        except ImportError:
            raise InvalidArgument("reading .safetensors needs the safetensors package") from None
        try:
            tensors = load_file(file)
        except Exception as exc:  # safetensors raises its own types for bad files
            raise InvalidArgument(f"{file}: not a readable safetensors file ({exc})") from None
    else:
        raise InvalidArgument("FILE must end in .npy or .safetensors")
    with _client(address, data_dir) as client:
        art = client.put(tensors, key, ttl=ttl)
        console.print(f"{art.id} {key} ({len(art.tensor_names)} tensors, {_size(art.nbytes)})")


@main.command()
@click.argument("key")
@click.argument("out", type=click.Path(dir_okay=False))
@_address_option
@_data_dir_option
def get(key: str, out: str, address: str | None, data_dir: str) -> None:
    """Write artifact KEY to OUT (.npy for one tensor, .safetensors for any)."""
    with _client(address, data_dir) as client:
        art = client.artifact(key)
        if out.endswith(".npy"):
            np.save(out, np.asarray(art.tensor(like="numpy")), allow_pickle=False)
        elif out.endswith(".safetensors"):
            from safetensors.numpy import save_file

            save_file({k: np.ascontiguousarray(v) for k, v in art.tensor_dict(like="numpy").items()}, out)
        else:
            raise InvalidArgument("OUT must end in .npy or .safetensors")
        console.print(f"wrote {out} ({_size(art.nbytes)})")


@main.command()
@click.argument("path", type=click.Path(exists=True))
@click.argument("key")
@click.option("--warm", "warm_on", default=None, metavar="WORKER",
              help="Also read the weights into WORKER's memory now (the warm path), with progress.")
@click.option("--tp", default=None, metavar="RANK/WORLD", help="With --warm: only this tensor-parallel rank.")
@click.option("--no-verify", is_flag=True, help="Do not refuse reads of files changed after registration.")
@_address_option
@_data_dir_option
def load(path: str, key: str, warm_on: str | None, tp: str | None, no_verify: bool, address: str | None,
         data_dir: str) -> None:
    """Register a safetensors checkpoint PATH under KEY (its bytes are read on use or with --warm)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    from tensorcast.views import TP

    tp_spec = None
    if tp is not None:
        try:
            rank, world = (int(x) for x in tp.split("/"))
        except ValueError:
            raise InvalidArgument(f"--tp expects RANK/WORLD, e.g. 0/2, got {tp!r}") from None
        tp_spec = TP(rank, world)
    with _client(address, data_dir) as client:
        art = client.from_disk(path, key, verify_checksums=not no_verify)
        console.print(f"{art.id} {key}: {len(art.tensor_names)} tensors, {_size(art.nbytes)}, model_type "
                      f"{art.info.meta.get('model_type') or '-'} (registered, not read)")
        if warm_on is None:
            return
        total = art.nbytes
        if tp_spec is not None:
            view = art.view(tp=tp_spec)
            total = sum(int(np.prod(view.shape(n), dtype=np.int64)) * art.meta(n).nbytes
                        // max(int(np.prod(art.meta(n).shape, dtype=np.int64)), 1) for n in view.tensor_names)
        before = next(w.memory_used for w in client.list_workers() if w.worker_id == warm_on)
        op = art.prefetch(to=warm_on, tp=tp_spec)
        with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                      TransferSpeedColumn(), console=console) as progress:
            task = progress.add_task(f"reading into {warm_on}", total=total)
            while not op.done():
                # Worker memory use arrives with heartbeats: coarse but real progress.
                used = next(w.memory_used for w in client.list_workers() if w.worker_id == warm_on)
                progress.update(task, completed=min(max(used - before, 0), total))
                time.sleep(0.2)
            result = op.result()
            progress.update(task, completed=total)
        console.print(f"warm on {warm_on}: {_size(result.bytes_moved)} in {result.seconds:.2f}s"
                      + (" (already there)" if result.already_present else ""))


@main.command(name="ls")
@click.argument("prefix", default="")
@_address_option
@_data_dir_option
def ls_cmd(prefix: str, address: str | None, data_dir: str) -> None:
    """List artifacts whose key starts with PREFIX."""
    with _client(address, data_dir) as client:
        table = Table()
        for col in ("key", "id", "tensors", "size", "owner", "replicas", "created"):
            table.add_column(col)
        for a in client.ls(prefix):
            created = datetime.datetime.fromtimestamp(a.info.created_at).strftime("%Y-%m-%d %H:%M:%S")
            table.add_row(", ".join(a.keys) or "-", a.id, str(len(a.tensor_names)), _size(a.nbytes), a.owner,
                          ",".join(r.worker_id for r in a.replicas), created)
        console.print(table)


@main.command()
@click.argument("key_or_id")
@_address_option
@_data_dir_option
def rm(key_or_id: str, address: str | None, data_dir: str) -> None:
    """Delete an artifact (by key or id)."""
    with _client(address, data_dir) as client:
        console.print(f"deleted {client.delete(key_or_id)}")
