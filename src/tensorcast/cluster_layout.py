"""What a ``LocalCluster`` is made of: its settings, its processes by name, where they are, and the command line
and environment each is started with.

Owns: ``ClusterLayout``, the base of ``LocalCluster``: its constructor's arguments, checked (workers, hosts,
etcd and global stores, token and its keyring, ``weights.allowed_roots`` defaulting to the working directory),
the per-cluster shared-memory prefix, the handles by name (global stores, workers, instances) and what they
tell (addresses, metrics and dashboard URLs, host ids and host indexes, the etcd prefix), the credentials it
hands out and the configuration callers need, and each process's command line: data directories under
``DATA_DIR``, ports (a fixed base spread with ``port_for``, a restart's kept port), the network namespace it
runs in, the worker credential in its environment. Nothing here starts a process. Does not own: starting,
stopping or faulting processes, the data directory's lock or ``cluster.json`` (``cluster``), or the mechanics
of one process (``cluster_processes``).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tensorcast.cluster_processes import ProcessHandle, port_for
from tensorcast.config import Config, default_host_id
from tensorcast.credentials import WORKER, Keyring
from tensorcast.errors import InvalidArgument
from tensorcast.netns import Hosts

__all__ = ["ClusterLayout"]


class ClusterLayout:
    """The settings and the processes of a ``LocalCluster`` (whose docstring describes the arguments)."""

    def __init__(
        self,
        workers: int = 1,
        hosts: int = 1,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        token: str | None = None,
        memory_capacity: str | int | None = None,
        disk_capacity: str | int | None = None,
        config: dict[str, Any] | None = None,
        roles: tuple[str, ...] = ("basic", "gateway", "shard-home"),
        startup_timeout: float = 90.0,  # an instance imports torch and transformers: slow on a busy host
        etcd: str | list[str] | None = None,
        global_stores: int = 1,
        netns: bool = False,
        tls: bool = False,
    ) -> None:
        if workers < 1 or hosts < 1 or hosts > workers:
            raise InvalidArgument("need workers >= 1 and 1 <= hosts <= workers")
        if global_stores < 1 or (global_stores > 1 and not etcd):
            raise InvalidArgument("need global_stores >= 1, and etcd=[...] for more than one (SQLite has one "
                                  "writer)")
        self.etcd = ",".join(etcd) if isinstance(etcd, list) else etcd
        self.n_global_stores = global_stores
        self.net: Hosts | None = Hosts(hosts + 1) if netns else None
        if netns and token is None:
            token = secrets.token_hex(16)
        self._tmp = None if data_dir is not None else tempfile.TemporaryDirectory(prefix="tensorcast-")
        self.data_dir = Path(data_dir if data_dir is not None else self._tmp.name).absolute()  # type: ignore[union-attr]
        self.n_workers = workers
        self.hosts = hosts
        self.token = token
        self.keyring = Keyring.from_token(token)
        if self.keyring is not None and not self.keyring.can(WORKER):
            raise InvalidArgument("a cluster's token must be the cluster secret or a worker credential")
        self.tls = tls
        self.memory_capacity = memory_capacity
        self.disk_capacity = disk_capacity
        self.roles = roles
        self.config = dict(config or {})
        if "weights.allowed_roots" not in self.config and "TENSORCAST_WEIGHTS_ALLOWED_ROOTS" not in os.environ:
            self.config["weights.allowed_roots"] = os.getcwd()  # a local cluster reads checkpoints from here
        self.startup_timeout = startup_timeout
        self.gs: ProcessHandle | None = None  # the first global store
        self.global_stores: list[ProcessHandle] = []
        self.workers: dict[str, ProcessHandle] = {}
        self.instances: dict[str, ProcessHandle] = {}
        self._config = Config()
        self._created = 0  # workers created so far: the next one's index (its ports)
        # Unique per cluster so concurrent clusters never share segment names.
        self.shm_prefix = f"tc{os.getpid()}x{int(time.time() * 1000) % 10**8}"

    # ----------------------------------------------------------------- where things are
    @property
    def address(self) -> str:
        """The gateway address callers connect to (the first worker)."""
        return next(iter(self.workers.values())).address

    @property
    def gs_address(self) -> str:
        assert self.gs is not None
        return self.gs.address

    @property
    def etcd_prefix(self) -> str:
        """This cluster's keys in etcd: ``gs.etcd_prefix`` when configured, else one derived from the data
        directory, so that a cluster started again on the same directory finds its metadata again."""
        if "gs.etcd_prefix" in self.config:
            return str(self.config["gs.etcd_prefix"])
        return f"/tensorcast/{hashlib.blake2b(str(self.data_dir).encode(), digest_size=8).hexdigest()}/"

    @property
    def gs_addresses(self) -> list[str]:
        """Every global store's address (workers are given them all)."""
        return [h.address for h in self.global_stores]

    @property
    def metrics_urls(self) -> dict[str, str]:
        """Where each process serves Prometheus metrics (``/metrics``), by name: "gs", the worker ids and the
        instance ids. Processes started with ``metrics.enabled = false`` are left out."""
        handles = [*self.global_stores, *self.workers.values(), *self.instances.values()]
        return {h.name: str(h.info["metrics_url"]) for h in handles if h.info and h.info.get("metrics_url")}

    @property
    def dashboard_url(self) -> str:
        """The dashboard, served by the global store ("" with metrics off)."""
        url = self.metrics_urls.get("gs", "")
        return url + "/" if url else ""

    @property
    def worker_ids(self) -> list[str]:
        return list(self.workers)

    def host_id_of(self, index: int) -> str:
        host = index % self.hosts
        if self.net is not None:
            return self.net.names[host]
        return default_host_id() if host == 0 else f"{default_host_id()}-h{host}"

    @property
    def gs_host(self) -> int:
        """With ``netns``: the host (namespace index) the global stores run on."""
        return self.hosts

    def host_of(self, worker_id: str) -> int:
        """The host index a worker runs on."""
        return self._worker(worker_id).host

    def _worker(self, worker_id: str) -> ProcessHandle:
        try:
            return self.workers[worker_id]
        except KeyError:
            raise InvalidArgument(f"no worker {worker_id!r}; workers: {list(self.workers)}") from None

    def _global_store(self, index: int) -> ProcessHandle:
        if not 0 <= index < len(self.global_stores):
            raise InvalidArgument(f"no global store {index}; there are {len(self.global_stores)}")
        return self.global_stores[index]

    def _on_host(self, host: int, args: list[str]) -> list[str]:
        """``args`` run on ``host`` (in its namespace, bound to its address), or as they are."""
        if self.net is None:
            return args
        return [*self.net.exec_args(host), *args, "--host", self.net.address(host)]

    def credential(self, role: str) -> str:
        """A credential of ``role`` (``worker``, ``client``, ``read-only``) for this cluster's token."""
        if self.keyring is None:
            raise InvalidArgument("this cluster runs without a token: there are no credentials")
        return self.keyring.credential(role)

    def client_config(self) -> Config:
        """The configuration a caller of this cluster needs (its TLS settings among them)."""
        return Config.load(None, self.config)

    # ----------------------------------------------------------------- processes
    def _common_env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.keyring is not None:  # the cluster's processes hold the worker credential, not the secret
            env["TENSORCAST_TOKEN"] = self.keyring.credential(WORKER)
        return env

    def _overrides(self) -> list[str]:
        return [f"--set={k}={v}" for k, v in self.config.items()]

    def _gs_handle(self, i: int) -> ProcessHandle:
        """Global store ``i`` ("gs", "gs1", ...), on the global stores' host, with its own data directory."""
        store = [] if not self.etcd else [f"--set=gs.etcd_endpoints={self.etcd}",
                                          f"--set=gs.etcd_prefix={self.etcd_prefix}"]
        name = "gs" if i == 0 else f"gs{i}"
        ready = self.data_dir / f"{name}.ready"
        args = self._on_host(self.gs_host, [
            sys.executable, "-m", "tensorcast", "gs", "--data-dir", str(self.data_dir / name), "--port", "0",
            "--ready-file", str(ready), *store, *self._overrides(), *self._ports(i)])
        return ProcessHandle(name, args, ready, self.data_dir / "logs" / f"{name}.log", host=self.gs_host)

    def _ports(self, offset: int, worker: bool = False) -> list[str]:
        """A fixed ``metrics.port`` (and ``worker.data_port``) is a base: every process takes its own port from
        it (``port_for``: the global stores first, then the workers), since they share one machine."""
        out = []
        if base := port_for(self._config.metrics.port, offset):
            out.append(f"--set=metrics.port={base}")
        if worker and (data := port_for(self._config.worker.data_port, offset - self.n_global_stores)):
            out.append(f"--set=worker.data_port={data}")
        return out

    @staticmethod
    def _keep_port(handle: ProcessHandle) -> None:
        """Restarts reuse the port (and the metrics port), so that peers, callers and scrapers reconnect to the
        same address."""
        handle.args[handle.args.index("--port") + 1] = handle.address.rsplit(":", 1)[1]
        assert handle.info is not None
        if handle.info.get("metrics_url"):
            handle.args.append(f"--set=metrics.port={str(handle.info['metrics_url']).rsplit(':', 1)[1]}")

    def _worker_prefix(self, wid: str) -> str:
        return f"{self.shm_prefix}-{wid}"

    def _worker_handle(self, wid: str, index: int, host: int | None = None) -> ProcessHandle:
        """Worker ``wid``, the ``index``-th created (its ports), on ``host`` (default: ``index % hosts``)."""
        assert self.gs is not None
        host = index % self.hosts if host is None else host
        ready = self.data_dir / f"{wid}.ready"
        home = self.data_dir / "workers" / wid
        args = self._on_host(host, [
            sys.executable, "-m", "tensorcast", "worker", "--gs", ",".join(self.gs_addresses), "--id", wid,
            "--port", "0", "--ready-file", str(ready), "--roles", ",".join(self.roles),
            "--host-id", self.host_id_of(host), f"--set=worker.shm_prefix={self.shm_prefix}",
            f"--set=worker.data_dir={home}", f"--set=worker.disk_dir={home / 'disk'}", *self._overrides(),
            *self._ports(self.n_global_stores + index, worker=True)])
        if self.memory_capacity is not None:
            args += ["--memory", str(self.memory_capacity)]
        if self.disk_capacity is not None:
            args.append(f"--set=worker.disk_capacity={self.disk_capacity}")
        self._created += 1
        return ProcessHandle(wid, args, ready, self.data_dir / "logs" / f"{wid}.log", host=host)

    def _instance_handle(self, instance_id: str, worker_id: str, args: list[str] | None, module: str) -> ProcessHandle:
        """An instance process of ``module`` attached to ``worker_id``; ``args``: its extra arguments."""
        ready = self.data_dir / f"{instance_id}.ready"
        cmd = [sys.executable, "-m", module, "--worker", self._worker(worker_id).address, "--id", instance_id,
               "--ready-file", str(ready), *(args or [])]
        return ProcessHandle(instance_id, cmd, ready, self.data_dir / "logs" / f"{instance_id}.log")

    def _instance_env(self) -> dict[str, str]:
        env = self._common_env()
        if self._config.metrics.port:  # a fixed port from a configuration file is for the cluster's own processes
            env["TENSORCAST_METRICS_PORT"] = "0"
        return env
