"""The ``tensorcast`` command line: run processes (``up``, ``gs``, ``worker``) and use a cluster
(``status``, ``put``, ``get``, ``load``, ``ls``, ``rm``).

Owns: flags, their mapping onto configuration keys, process entry points (signal handling, logging), watching
the processes of ``up``, and human-readable output. Client commands find the cluster from ``--address``,
``TENSORCAST_ADDRESS`` or ``DATA_DIR/cluster.json``, and authenticate with ``--token``/``TENSORCAST_TOKEN``.
Errors print one line and exit non-zero; no tracebacks for user mistakes. Reading and writing files is
``cli_files``'s job.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table
from rich.text import Text

from tensorcast.cli_files import (
    METADATA_SUFFIX,
    PROGRESS_BYTES,
    byte_progress,
    check_suffix,
    checkpoint_files,
    download,
    get_metadata,
    output_file,
    put_metadata,
    read_tensors,
    size,
    upload,
    write_tensors,
)
from tensorcast.config import Config
from tensorcast.errors import InvalidArgument, NotFound, TensorCastError
from tensorcast.pool.placement import PRESETS
from tensorcast.views import TP

if TYPE_CHECKING:
    import subprocess

    from tensorcast.client.sync import Artifact, Client
    from tensorcast.cluster import LocalCluster

# Piped into a file or another program, a table keeps whole cells (rich would cut them to 80 columns).
_piped = not sys.stdout.isatty() and "COLUMNS" not in os.environ
console = Console(width=1000 if _piped else None)
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
            # A Text, not markup: messages hold paths and keys, and "[...]" in them is not a style.
            err_console.print(Text.assemble(("error", "red"), f" {exc}"), soft_wrap=True)
            sys.exit(2)


def _say(line: str) -> None:
    """One plain line on stdout: never wrapped (logs and scripts read it whole), no markup in names."""
    console.print(line, soft_wrap=True, markup=False, highlight=False)


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
@click.option("--etcd", default=None, metavar="URL[,URL...]",
              help="Keep the metadata on this etcd cluster (then several global stores may serve it).")
@_config_option
@_set_option
def gs(data_dir: str, host: str | None, port: int | None, ready_file: str | None, etcd: str | None,
       config_path: str | None, sets: tuple[str, ...]) -> None:
    """Run the global store (SQLite in DATA_DIR, or on etcd with --etcd)."""
    from tensorcast.gs.service import run_global_store

    config = Config.load(config_path, _overrides(sets, {"gs.host": host, "gs.port": port,
                                                         "gs.etcd_endpoints": etcd}))
    _check_bind(config.gs.host, config.token)
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    _serve("gs", lambda stop: run_global_store(config, Path(data_dir), Path(ready_file) if ready_file else None,
                                               stop))


@main.command()
@click.option("--gs", "gs_address", required=True,
              help="Global store address HOST:PORT, or several (HOST:PORT,HOST:PORT) serving one etcd.")
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
@click.option("--restart-dead", is_flag=True, help="Restart a worker (or the global store) that died.")
@click.option("--etcd", default=None, metavar="URL[,URL...]", help="Keep the metadata on this etcd cluster.")
@click.option("--global-stores", type=click.IntRange(min=1), default=1, show_default=True,
              help="Global-store processes serving it at once (more than one needs --etcd).")
@_config_option
@_set_option
def up(workers: int, hosts: int, data_dir: str, memory: str | None, restart_dead: bool, etcd: str | None,
       global_stores: int, config_path: str | None, sets: tuple[str, ...]) -> None:
    """Start a local cluster (global store + workers) until Ctrl-C; say when one of its processes dies."""
    from tensorcast.cluster import LocalCluster
    from tensorcast.obs.tracing import check_exporter

    if global_stores > 1 and not etcd:
        raise InvalidArgument("--global-stores above 1 needs --etcd (SQLite has one writer)")
    # Configuration mistakes are refused here, in one line, before any process starts.
    config = Config.load(config_path, {**_overrides(sets, {}), "gs.etcd_endpoints": etcd})
    check_exporter(config.tracing)
    if config_path:  # every process of the cluster reads the same file (they inherit the environment)
        os.environ["TENSORCAST_CONFIG"] = os.path.abspath(config_path)
    if etcd:
        from tensorcast.gs.etcd_client import check_reachable

        check_reachable(etcd)
    cluster = LocalCluster(workers=workers, hosts=hosts, data_dir=data_dir, memory_capacity=memory,
                           config=_overrides(sets, {}), token=os.environ.get("TENSORCAST_TOKEN"), etcd=etcd,
                           global_stores=global_stores)
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with cluster:
        _say(f"TensorCast cluster up: gateway {cluster.address}, global store{'s' if global_stores > 1 else ''} "
             f"{', '.join(cluster.gs_addresses)}" + (f" on etcd {etcd}" if etcd else ""))
        _say("processes: " + ", ".join(f"{name} pid {pid}" for name, pid in cluster.pids().items())
             + f"; logs in {cluster.data_dir / 'logs'}")
        _say(f"wrote {Path(data_dir) / 'cluster.json'}; export TENSORCAST_ADDRESS={cluster.address}")
        if cluster.dashboard_url:
            _say(f"dashboard {cluster.dashboard_url} (the same in a terminal: tensorcast status --watch); "
                 f"metrics: tensorcast status --json")
        _say("Ctrl-C to stop.")
        watchdog = _Watchdog(cluster, restart=restart_dead)
        # The handler sets the event, which ends the wait at once; otherwise look at the processes each second.
        while not stop.wait(1.0):
            watchdog.check()
        _say("stopping...")


class _Watchdog:
    """Says once, in one line, when a process of ``up``'s cluster died (its exit code or signal and its log),
    and with ``restart`` starts it again on the same port (once per death; not again if that start fails)."""

    def __init__(self, cluster: LocalCluster, restart: bool) -> None:
        self.cluster = cluster
        self.restart = restart
        self._reported: set[subprocess.Popen[bytes]] = set()  # already said; a restart makes a new Popen
        self._given_up: set[str] = set()

    def check(self) -> None:
        stores = [(h.name, h) for h in self.cluster.global_stores]
        for name, handle in [*stores, *self.cluster.workers.items()]:
            if handle is None or handle.popen is None or handle.alive() or handle.popen in self._reported:
                continue
            popen = handle.popen
            self._reported.add(popen)
            _say(f"{_label(name)} (pid {popen.pid}) died: {_exit_reason(popen.returncode)}; log: {handle.log_path}")
            if self.restart and name not in self._given_up:
                self._restart(name)

    def _restart(self, name: str) -> None:
        stores = [h.name for h in self.cluster.global_stores]
        try:
            if name in stores:
                self.cluster.restart_global_store(stores.index(name))
            else:
                self.cluster.restart_worker(name)
        except TensorCastError as exc:
            self._given_up.add(name)
            _say(f"could not restart {_label(name)}: {exc}; not trying again")
            return
        handle = self.cluster.global_stores[stores.index(name)] if name in stores else self.cluster.workers[name]
        _say(f"restarted {_label(name)}: pid {handle.pid}, address {handle.address}")


def _label(name: str) -> str:
    return f"global store{'' if name == 'gs' else ' ' + name[2:]}" if name.startswith("gs") else f"worker {name}"


def _exit_reason(returncode: int) -> str:
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-returncode).name}"
        return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


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


def _client_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--address``, ``--data-dir`` and ``--token``: how every client command finds and joins the cluster."""
    f = click.option("--token", envvar="TENSORCAST_TOKEN", default=None, show_envvar=True,
                     help="Cluster token, when the cluster has one (the variable keeps it out of `ps`).")(f)
    f = click.option("--data-dir", default="./tc-data", show_default=True,
                     help="Where `tensorcast up` wrote cluster.json.")(f)
    return click.option("--address", default=None, help="Gateway HOST:PORT.")(f)


def _client(address: str | None, data_dir: str, token: str | None) -> Client:
    from tensorcast.client.sync import connect

    return connect(_address(address, data_dir), token)


@main.command()
@click.option("--shards", "show_shards", is_flag=True, help="List every shard lease, not just a summary.")
@click.option("--json", "as_json", is_flag=True, help="Print the dashboard's view (and every metrics URL) as JSON.")
@click.option("--watch", is_flag=True, help="Redraw the dashboard's view in the terminal until interrupted.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              help="Seconds between redraws with --watch.")
@_client_options
def status(show_shards: bool, as_json: bool, watch: bool, interval: float, address: str | None, data_dir: str,
           token: str | None) -> None:
    """Show the cluster's workers, instances and KV shard leases."""
    from tensorcast.cli_status import cluster_state, instance_table, shard_table, worker_table

    with _client(address, data_dir, token) as client:
        if as_json:
            click.echo(json.dumps(cluster_state(client), indent=2))
            return
        if watch:
            _watch(client, interval)
            return
        console.print(worker_table(client))
        instances = instance_table(client)
        if instances is not None:
            console.print(instances)
        console.print(shard_table(client, show_shards))


def _watch(client: Client, interval: float) -> None:
    """Redraw the view in place on a terminal; elsewhere (a pipe, a file), print one frame per interval. Ctrl-C
    (SIGINT) ends it between two frames: raised as KeyboardInterrupt at any point, it could stop the main thread
    while it holds a lock the client's close then waits for (a logging handler's, say), and the exit would hang."""
    from rich.live import Live

    from tensorcast.cli_status import cluster_state, view_tables

    stop = threading.Event()
    on_main = threading.current_thread() is threading.main_thread()  # where signal handlers can be set
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set()) if on_main else None
    try:
        if not console.is_terminal:
            while not stop.is_set():
                console.print(view_tables(cluster_state(client)))
                console.file.flush()
                stop.wait(interval)
            return
        with Live(view_tables(cluster_state(client)), console=console, auto_refresh=False) as live:
            while not stop.wait(interval):
                live.update(view_tables(cluster_state(client)), refresh=True)
    except KeyboardInterrupt:  # off the main thread, or before the handler was set
        pass
    finally:
        if previous is not None:  # None also for a handler set outside Python: left as it is now
            signal.signal(signal.SIGINT, previous)


def _progress(nbytes: int) -> contextlib.AbstractContextManager[Progress | None]:
    """Byte progress bars on stderr for transfers above ``PROGRESS_BYTES``; nothing for small ones."""
    return byte_progress(err_console) if nbytes > PROGRESS_BYTES else contextlib.nullcontext()


@main.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("key")
@click.option("--ttl", type=float, default=None, help="Caller lease in seconds (default: system-owned).")
@click.option("--policy", type=click.Choice(list(PRESETS)), default=None,
              help="Placement preset (default: cache).")
@_client_options
def put(file: Path, key: str, ttl: float | None, policy: str | None, address: str | None, data_dir: str,
        token: str | None) -> None:
    """Store a .npy or .safetensors FILE under KEY.

    A safetensors file's __metadata__ is kept as a companion artifact, KEY.__metadata__ (its JSON as one
    uint8 tensor): `get` writes it back, `rm KEY` deletes it. Files over 64 MiB show progress (reading,
    then uploading) on stderr.
    """
    check_suffix(file, "FILE")
    if key.endswith(METADATA_SUFFIX):
        raise InvalidArgument(f"keys ending in {METADATA_SUFFIX} hold safetensors metadata; choose another KEY")
    with _client(address, data_dir, token) as client, _progress(file.stat().st_size) as progress:
        data = read_tensors(file, progress)
        art = upload(client, data.tensors, key, ttl, policy, progress)
        put_metadata(client, key, data.metadata, ttl, policy)
    _say(f"{art.id} {key} ({len(art.tensor_names)} tensors, {size(art.nbytes)}"
         + (", with safetensors metadata)" if data.metadata else ")"))


@main.command()
@click.argument("key")
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@_client_options
def get(key: str, out: Path, address: str | None, data_dir: str, token: str | None) -> None:
    """Write artifact KEY to OUT (.npy for one tensor, .safetensors for any).

    A .safetensors OUT gets back the __metadata__ that `put` kept for KEY (in KEY.__metadata__). OUT is
    written under a temporary name and renamed when complete. Artifacts over 64 MiB show download progress
    on stderr.
    """
    check_suffix(out, "OUT")
    metadata = None
    with output_file(out) as part, _client(address, data_dir, token) as client:
        art = client.artifact(key)
        with _progress(art.nbytes) as progress:
            tensors = download(art, progress)
        if out.suffix == ".safetensors":
            metadata = get_metadata(client, key)
        write_tensors(out, part, tensors, metadata)
    _say(f"wrote {out} ({size(art.nbytes)}" + (", with safetensors metadata)" if metadata else ")"))


def _parse_tp(tp: str | None) -> TP | None:
    if tp is None:
        return None
    try:
        rank, world = (int(x) for x in tp.split("/"))
    except ValueError:
        raise InvalidArgument(f"--tp expects RANK/WORLD, e.g. 0/2, got {tp!r}") from None
    return TP(rank, world)


@main.command()
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@click.argument("key")
@click.option("--warm", "warm_on", default=None, metavar="WORKER",
              help="Also read the weights into WORKER's memory now (the warm path), with progress.")
@click.option("--tp", default=None, metavar="RANK/WORLD", help="With --warm: only this tensor-parallel rank.")
@click.option("--no-verify", is_flag=True, help="Do not refuse reads of files changed after registration.")
@_client_options
def load(path: Path, key: str, warm_on: str | None, tp: str | None, no_verify: bool, address: str | None,
         data_dir: str, token: str | None) -> None:
    """Register a safetensors checkpoint PATH under KEY (its bytes are read on use or with --warm).

    Registration reads every file's header (a spinner on stderr says how many files); --warm then shows
    the bytes read into the worker."""
    tp_spec = _parse_tp(tp)
    files = checkpoint_files(path)
    with _client(address, data_dir, token) as client:
        with err_console.status(escape(f"registering {path}: reading the headers of {len(files)} file(s), "
                                       f"{size(sum(f.stat().st_size for f in files))}")):
            art = client.from_disk(path, key, verify_checksums=not no_verify)
        _say(f"{art.id} {key}: {len(art.tensor_names)} tensors, {size(art.nbytes)}, model_type "
             f"{art.info.meta.get('model_type') or '-'} (registered, not read)")
        if warm_on is not None:
            _warm(client, art, warm_on, tp_spec)


def _warm(client: Client, art: Artifact, warm_on: str, tp_spec: TP | None) -> None:
    total = art.nbytes
    if tp_spec is not None:
        view = art.view(tp=tp_spec)
        total = sum(int(np.prod(view.shape(n), dtype=np.int64)) * art.meta(n).nbytes
                    // max(int(np.prod(art.meta(n).shape, dtype=np.int64)), 1) for n in view.tensor_names)
    before = next(w.memory_used for w in client.list_workers() if w.worker_id == warm_on)
    op = art.prefetch(to=warm_on, tp=tp_spec)
    with byte_progress(err_console) as progress:
        task = progress.add_task(f"reading into {warm_on}", total=total)
        while not op.done():
            # Worker memory use arrives with heartbeats: coarse but real progress.
            used = next(w.memory_used for w in client.list_workers() if w.worker_id == warm_on)
            progress.update(task, completed=min(max(used - before, 0), total))
            time.sleep(0.2)
        result = op.result()
        progress.update(task, completed=total)
    _say(f"warm on {warm_on}: {size(result.bytes_moved)} in {result.seconds:.2f}s"
         + (" (already there)" if result.already_present else ""))


@main.command(name="ls")
@click.argument("prefix", default="")
@_client_options
def ls_cmd(prefix: str, address: str | None, data_dir: str, token: str | None) -> None:
    """List artifacts whose key starts with PREFIX (KEY.__metadata__ rows: safetensors metadata of KEY)."""
    with _client(address, data_dir, token) as client:
        table = Table()
        for col in ("key", "id", "tensors", "size", "owner", "replicas", "created"):
            table.add_column(col)
        for a in client.ls(prefix):
            created = datetime.datetime.fromtimestamp(a.info.created_at).strftime("%Y-%m-%d %H:%M:%S")
            table.add_row(escape(", ".join(a.keys)) or "-", a.id, str(len(a.tensor_names)), size(a.nbytes),
                          a.owner, ",".join(r.worker_id for r in a.replicas), created)
        console.print(table)


@main.command()
@click.argument("key_or_id")
@_client_options
def rm(key_or_id: str, address: str | None, data_dir: str, token: str | None) -> None:
    """Delete an artifact (by key or id), and the safetensors metadata `put` kept for that key."""
    with _client(address, data_dir, token) as client:
        _say(f"deleted {client.delete(key_or_id)}")
        with contextlib.suppress(NotFound):
            _say(f"deleted {client.delete(key_or_id + METADATA_SUFFIX)} ({key_or_id}{METADATA_SUFFIX})")
