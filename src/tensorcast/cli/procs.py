"""The ``tensorcast`` commands that run processes: ``gs``, ``worker``, ``up``, and ``add-worker``/``stop-worker``
for a running ``up``.

Owns: their flags and the mapping onto configuration keys; the process entry (logging, SIGTERM/SIGINT/SIGHUP
stop the process cleanly, it follows its parent when a ``LocalCluster`` started it, a port that cannot be bound
is one line); each data directory's lock (the global store's ``--data-dir``; a worker's with ``--data-dir``,
``worker.datadir``; ``up``'s whole directory, through ``LocalCluster``); ``up``'s banner, its watch over its
processes (a death said once, ``--restart-dead``) and its answers to ``add-worker``/``stop-worker``
(``cli.control``). Does not own: client commands (``cli.commands``), what the processes do.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from tensorcast.cli.common import check_binds, overrides, say
from tensorcast.cli.control import request, serve_requests
from tensorcast.cli.files import size
from tensorcast.config import Config
from tensorcast.errors import InvalidArgument, TensorCastError
from tensorcast.lockfile import DirLock

if TYPE_CHECKING:
    import subprocess

    from tensorcast.cluster import LocalCluster

__all__ = ["add_worker", "gs", "stop_worker", "up", "worker"]

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # SIGHUP: the terminal was closed
_BIND_ERRORS = (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES)


def _serve(name: str, coro_factory: Any, drain: asyncio.Event | None = None) -> None:
    """Run a server coroutine until SIGTERM/SIGINT/SIGHUP (or its parent's end, when it has one to follow),
    then let it clean up. With ``drain``, SIGTERM also sets it: a graceful stop that hands work over first, as
    an orchestrator's stop asks (SIGINT, SIGHUP and the parent's end stop at once)."""
    from tensorcast.client.loop import new_event_loop
    from tensorcast.lifetime import follow_parent
    from tensorcast.log import setup_logging

    setup_logging(name)
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    stop = asyncio.Event()
    for sig in _STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    if drain is not None:
        def drain_then_stop() -> None:
            drain.set()
            stop.set()

        loop.add_signal_handler(signal.SIGTERM, drain_then_stop)

    def parent_gone() -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed meanwhile
            loop.call_soon_threadsafe(stop.set)

    follow_parent(parent_gone)
    try:
        loop.run_until_complete(coro_factory(stop))
    except OSError as exc:
        if exc.errno in _BIND_ERRORS:
            raise InvalidArgument(f"{name} cannot listen: {exc.strerror}; choose another port (0: a free one)") \
                from None
        raise
    finally:
        loop.close()


_set_option = click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
                           help="Override a configuration key, e.g. worker.memory_capacity=2GiB.")
_config_option = click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
                              help="TOML configuration file.")


@click.command()
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
    """Run the global store (SQLite in DATA_DIR, or on etcd with --etcd). DATA_DIR is this process's while it
    runs: a second global store on it is refused."""
    from tensorcast.gs.service import run_global_store

    config = Config.load(config_path, overrides(sets, {"gs.host": host, "gs.port": port, "gs.etcd_endpoints": etcd}))
    check_binds(config, config.gs.host)
    lock = DirLock.acquire(Path(data_dir), "global store data directory")
    try:
        _serve("gs", lambda stop: run_global_store(config, Path(data_dir), Path(ready_file) if ready_file else None,
                                                   stop))
    finally:
        lock.release()


@click.command()
@click.option("--gs", "gs_address", required=True,
              help="Global store address HOST:PORT, or several (HOST:PORT,HOST:PORT) serving one etcd.")
@click.option("--id", "worker_id", required=True, help="Stable worker id (kept across restarts).")
@click.option("--host", default=None)
@click.option("--port", type=int, default=None)
@click.option("--roles", default=None, help="Comma-separated roles (default basic,gateway,shard-home).")
@click.option("--memory", default=None, help="Memory tier capacity, e.g. 8GiB.")
@click.option("--host-id", default=None, help="Host identity for same-host decisions.")
@click.option("--data-dir", default=None, type=click.Path(file_okay=False),
              help="A directory this worker owns while it runs (worker.data_dir): a second worker on it is "
                   "refused, and the shared memory a killed predecessor left is freed.")
@click.option("--ready-file", type=click.Path(dir_okay=False), default=None)
@_config_option
@_set_option
def worker(gs_address: str, worker_id: str, host: str | None, port: int | None, roles: str | None,
           memory: str | None, host_id: str | None, data_dir: str | None, ready_file: str | None,
           config_path: str | None, sets: tuple[str, ...]) -> None:
    """Run a worker."""
    from tensorcast.worker.server import run_worker

    config = Config.load(config_path, overrides(sets, {
        "worker.host": host, "worker.port": port, "worker.roles": roles, "worker.memory_capacity": memory,
        "worker.host_id": host_id, "worker.data_dir": data_dir}))
    check_binds(config, config.worker.host)
    drain = asyncio.Event()  # SIGTERM: hand the KV shards over first; SIGINT: stop at once
    _serve(f"worker-{worker_id}", lambda stop: run_worker(config, worker_id, gs_address,
                                                          Path(ready_file) if ready_file else None, stop, drain),
           drain)


@click.command()
@click.option("--workers", type=int, default=2, show_default=True)
@click.option("--hosts", type=int, default=1, show_default=True, help="Simulated hosts (network path).")
@click.option("--data-dir", type=click.Path(file_okay=False), default="./tc-data", show_default=True)
@click.option("--memory", default=None, help="Memory tier per worker, e.g. 4GiB.")
@click.option("--restart-dead", is_flag=True, help="Restart a worker (or the global store) that died.")
@click.option("--etcd", default=None, metavar="URL[,URL...]", help="Keep the metadata on this etcd cluster.")
@click.option("--global-stores", type=click.IntRange(min=1), default=1, show_default=True,
              help="Global-store processes serving it at once (more than one needs --etcd).")
@click.option("--tls", "make_tls", is_flag=True,
              help="TLS on every port, with a CA and a certificate made for this cluster in DATA_DIR/tls.")
@click.option("--tls-cert", type=click.Path(dir_okay=False, exists=True), default=None,
              help="TLS on every port with this certificate chain (PEM); with --tls-key and --tls-ca.")
@click.option("--tls-key", type=click.Path(dir_okay=False, exists=True), default=None)
@click.option("--tls-ca", type=click.Path(dir_okay=False, exists=True), default=None,
              help="The CA certificates every peer's certificate must chain to.")
@_config_option
@_set_option
def up(workers: int, hosts: int, data_dir: str, memory: str | None, restart_dead: bool, etcd: str | None,
       global_stores: int, make_tls: bool, tls_cert: str | None, tls_key: str | None, tls_ca: str | None,
       config_path: str | None, sets: tuple[str, ...]) -> None:
    """Start a local cluster (global store + workers) until Ctrl-C, SIGTERM or SIGHUP; say when one of its
    processes dies. DATA_DIR is this cluster's while it runs: a second `up` on it is refused. Add or stop
    workers meanwhile with `tensorcast add-worker` / `stop-worker`. With TENSORCAST_TOKEN (the cluster secret)
    every caller needs a credential; `up` prints a client one."""
    from tensorcast.cluster import LocalCluster
    from tensorcast.obs.tracing import check_exporter

    if global_stores > 1 and not etcd:
        raise InvalidArgument("--global-stores above 1 needs --etcd (SQLite has one writer)")
    files = {"tls.cert_file": tls_cert, "tls.key_file": tls_key, "tls.ca_file": tls_ca}
    if any(files.values()) and (make_tls or not all(files.values())):
        raise InvalidArgument("TLS takes --tls (certificates made here) or all of --tls-cert, --tls-key and --tls-ca")
    tls_sets = {**files, "tls.enabled": "true"} if all(files.values()) else {}
    # Configuration mistakes are refused here, in one line, before any process starts.
    config = Config.load(config_path, {**overrides(sets, {"worker.memory_capacity": memory, **tls_sets}),
                                       "gs.etcd_endpoints": etcd})
    check_exporter(config.tracing)
    if config_path:  # every process of the cluster reads the same file (they inherit the environment)
        os.environ["TENSORCAST_CONFIG"] = os.path.abspath(config_path)
    if etcd:
        from tensorcast.gs.etcd_client import check_reachable

        check_reachable(etcd)
    cluster = LocalCluster(workers=workers, hosts=hosts, data_dir=data_dir, memory_capacity=memory,
                           config=overrides(sets, tls_sets), token=os.environ.get("TENSORCAST_TOKEN"), etcd=etcd,
                           global_stores=global_stores, tls=make_tls)
    stop = threading.Event()
    for sig in _STOP_SIGNALS:
        signal.signal(sig, lambda signum, frame: stop.set())
    with cluster:
        _banner(cluster, config, etcd)
        watchdog = _Watchdog(cluster, restart=restart_dead)
        # The handler sets the event, which ends the wait at once; otherwise look at the processes each second.
        while not stop.wait(1.0):
            watchdog.check()
            serve_requests(cluster, cluster.data_dir, say)
        say("stopping...")


def _banner(cluster: LocalCluster, config: Config, etcd: str | None) -> None:
    stores = cluster.gs_addresses
    say(f"TensorCast cluster up: gateway {cluster.address}, global store{'s' if len(stores) > 1 else ''} "
        f"{', '.join(stores)}" + (f" on etcd {etcd}" if etcd else ""))
    say("processes: " + ", ".join(f"{name} pid {pid}" for name, pid in cluster.pids().items())
        + f"; logs in {cluster.data_dir / 'logs'}")
    w = config.worker
    say(f"each worker: a {size(w.memory_capacity)} memory tier, plus {size(w.prefault_bytes)} of shared memory "
        "pre-faulted once idle, for fills without page faults (worker.prefault_bytes; 0 turns it off)"
        if w.prefault_bytes else
        f"each worker: a {size(w.memory_capacity)} memory tier")
    say(f"wrote {cluster.data_dir / 'cluster.json'}; export TENSORCAST_ADDRESS={cluster.address}")
    roots = ", ".join(cluster.client_config().weights.allowed_roots) or "none"
    say(f"from_disk registers checkpoints under {roots} and the workers' data dirs only (weights.allowed_roots)")
    _security_banner(cluster)
    if cluster.dashboard_url:
        say(f"dashboard {cluster.dashboard_url} (the same in a terminal: tensorcast status --watch); "
            f"metrics: tensorcast status --json")
    say("Ctrl-C to stop.")


def _security_banner(cluster: LocalCluster) -> None:
    """Who can get in: anyone on this machine without a token; callers need a credential (and TLS) with one."""
    if cluster.keyring is None:
        say("no token: this cluster is open to every local user (any UID may read, write and delete everything); "
            "set TENSORCAST_TOKEN to a secret to require credentials (docs/security.md)")
    else:
        say(f"callers need a credential: export TENSORCAST_TOKEN={cluster.credential('client')} (a client's; "
            "`tensorcast credential --role read-only` makes others from the secret)")
    tls = cluster.client_config().tls
    if tls.enabled:
        say(f"TLS on every port: export TENSORCAST_TLS_ENABLED=true TENSORCAST_TLS_CA_FILE={tls.ca_file}"
            + (f" (client certificate: {tls.cert_file})" if tls.require_client_cert else ""))


class _Watchdog:
    """Says once, in one line, when a process of ``up``'s cluster died (its exit code or signal and its log),
    and with ``restart`` starts it again on the same port (once per death; not again if that start fails).
    A dead worker left dead has its shared memory freed at once."""

    def __init__(self, cluster: LocalCluster, restart: bool) -> None:
        self.cluster = cluster
        self.restart = restart
        self._reported: set[subprocess.Popen[bytes]] = set()  # already said; a restart makes a new Popen
        self._given_up: set[str] = set()

    def check(self) -> None:
        from tensorcast.cluster_processes import exit_reason

        stores = [(h.name, h) for h in self.cluster.global_stores]
        for name, handle in [*stores, *self.cluster.workers.items()]:
            if handle is None or handle.popen is None or handle.alive() or handle.popen in self._reported:
                continue
            popen = handle.popen
            self._reported.add(popen)
            say(f"{_label(name)} (pid {popen.pid}) died: {exit_reason(popen.returncode)}; log: {handle.log_path}")
            if self.restart and name not in self._given_up:
                self._restart(name)
            elif name in self.cluster.workers and (freed := self.cluster.free_segments(name)):
                say(f"freed {freed} shared-memory segments of {_label(name)}")

    def _restart(self, name: str) -> None:
        stores = [h.name for h in self.cluster.global_stores]
        try:
            if name in stores:
                self.cluster.restart_global_store(stores.index(name))
            else:
                self.cluster.restart_worker(name)
        except TensorCastError as exc:
            self._given_up.add(name)
            say(f"could not restart {_label(name)}: {exc}; not trying again")
            return
        handle = self.cluster.global_stores[stores.index(name)] if name in stores else self.cluster.workers[name]
        say(f"restarted {_label(name)}: pid {handle.pid}, address {handle.address}")


def _label(name: str) -> str:
    return f"global store{'' if name == 'gs' else ' ' + name[2:]}" if name.startswith("gs") else f"worker {name}"


_up_dir_option = click.option("--data-dir", type=click.Path(file_okay=False), default="./tc-data",
                              show_default=True, help="The running `tensorcast up`'s data directory.")
_timeout_option = click.option("--timeout", type=click.FloatRange(min=1), default=300.0, show_default=True,
                               help="Seconds to wait for `up` to answer.")


@click.command(name="add-worker")
@click.option("--id", "worker_id", default=None, help="The new worker's id (default: the first free wN).")
@click.option("--host", type=int, default=None, help="With `up --hosts N`: the simulated host (0..N-1).")
@_up_dir_option
@_timeout_option
def add_worker(worker_id: str | None, host: int | None, data_dir: str, timeout: float) -> None:
    """Add a worker to the `tensorcast up` running on DATA_DIR, configured as its others; returns once it has
    joined and taken its share of the KV shards."""
    answer = request(Path(data_dir), {"op": "add-worker", "worker_id": worker_id, "host": host}, timeout)
    say(f"added worker {answer['worker_id']}: pid {answer['pid']}, address {answer['address']}")


@click.command(name="stop-worker")
@click.argument("worker_id")
@_up_dir_option
@_timeout_option
def stop_worker(worker_id: str, data_dir: str, timeout: float) -> None:
    """Stop worker WORKER_ID of the `tensorcast up` running on DATA_DIR gracefully (it drains, then exits)."""
    answer = request(Path(data_dir), {"op": "stop-worker", "worker_id": worker_id}, timeout)
    say(f"stopped worker {worker_id} (exit code {answer['exit_code']})")
