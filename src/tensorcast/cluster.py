"""``LocalCluster``: a global store and N workers as separate processes on loopback.

Owns: which processes a cluster has and their arguments (data directories, shared-memory prefix, ports),
starting them and returning once the KV shard table has settled, adding and stopping workers while it runs,
the data directory's lock (one cluster at a time), writing ``cluster.json``, stopping everything (also at
interpreter exit), and the fault hooks tests and demos use (kill -9, restart, SIGSTOP/SIGCONT, restart of the
global store on the same data directory and port). The mechanics of one process (spawning it to die with
this one, its ready file, its start-up failure in one line) are ``cluster_processes``'. Does not own: what
the processes do.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import secrets
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tensorcast.certs import cluster_tls
from tensorcast.cluster_processes import (
    STOP_TIMEOUT,
    ProcessHandle,
    port_for,
    settle_timeout,
    stop_handles,
    wait_settled,
)
from tensorcast.config import Config, default_host_id
from tensorcast.credentials import WORKER, Keyring
from tensorcast.errors import InvalidArgument
from tensorcast.lockfile import DirLock
from tensorcast.netns import Hosts
from tensorcast.pool.segments import remove_stale_segments

__all__ = ["LocalCluster", "ProcessHandle"]


class LocalCluster:
    """A local cluster for demos, tests and benchmarks.

    ``hosts`` > 1 gives workers distinct host ids (worker i is on host i % hosts; host 0 is this machine),
    so traffic between "hosts" takes the network path although everything runs here.

    ``etcd`` (client URLs, a list or comma-separated) keeps the metadata on that etcd cluster, under a key
    prefix of this cluster's own; then ``global_stores`` processes serve it at once ("gs", "gs1", ...), and
    every worker knows them all and fails over between them.

    ``netns=True`` makes the hosts real: each in its own network namespace with its own address
    (``tensorcast.netns.Hosts``; needs root), the global stores on one more host of their own
    (``gs_host``), so that processes on different hosts talk only over a network that ``cluster.net``
    can partition, slow down or make lossy. Such a cluster needs a token (one is made when none is given):
    it binds addresses other than loopback.

    ``token`` is the cluster secret: its processes get the worker credential derived from it
    (``credential``), callers may connect with the secret or any credential. ``tls=True`` runs every port with
    TLS on certificates of a CA made for it in ``DATA_DIR/tls`` (``client_config()`` is what callers need);
    TLS configured in ``config`` (``tls.*`` keys, files of your own) is used as it is.

    ``from_disk`` reads checkpoints under the directory the cluster was started from (and the workers' data
    dirs) unless ``weights.allowed_roots`` is configured (``config``, ``TENSORCAST_WEIGHTS_ALLOWED_ROOTS``).
    """

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
        self._lock: DirLock | None = None
        self._config = Config()
        self._created = 0  # workers created so far: the next one's index (its ports)
        # Unique per cluster so concurrent clusters never share segment names.
        self.shm_prefix = f"tc{os.getpid()}x{int(time.time() * 1000) % 10**8}"

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

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

    def _on_host(self, host: int, args: list[str]) -> list[str]:
        """``args`` run on ``host`` (in its namespace, bound to its address), or as they are."""
        if self.net is None:
            return args
        return [*self.net.exec_args(host), *args, "--host", self.net.address(host)]

    def start(self) -> None:
        """Start the global store(s) and the workers; return once every worker is ready and the KV shard table
        has settled (every shard held by its HRW home, so that pages put from now on stay where they land).
        The data directory is this cluster's until ``stop()``: a second cluster on it is refused, naming this
        one. Stopped at interpreter exit at the latest, and its processes end if this one dies."""
        self._lock = DirLock.acquire(self.data_dir, "data directory")  # first: nothing of a running cluster is touched
        try:
            if self.tls:
                hosts = [self.net.address(h) for h in range(self.hosts + 1)] if self.net is not None else []
                self.config = {**cluster_tls(self.data_dir / "tls", hosts), **self.config}
            self._config = Config.load(None, self.config)  # what every process reads (file, environment, overrides)
            (self.data_dir / "logs").mkdir(parents=True, exist_ok=True)
            atexit.register(self.stop)
            if self.net is not None:
                self.net.start()
            self._start_gs()
            handles = [self._worker_handle(f"w{i}", i) for i in range(self.n_workers)]
            for handle in handles:
                self.workers[handle.name] = handle
                handle.spawn(self._common_env())
            for handle in handles:
                handle.wait_ready(self.startup_timeout)
                self._keep_port(handle)
            self._wait_settled()
        except BaseException:
            self.stop()
            raise
        self._write_manifest()
        self._lock.update(address=self.address)

    def _wait_settled(self, gone: frozenset[str] = frozenset()) -> None:
        if not {"shard-home", "gateway"} <= set(self.roles):  # no shard homes, or no gateway to ask
            return
        kv = self._config.kv
        wait_settled(self.address, self.token, kv.lease_ttl,
                     settle_timeout(kv.lease_ttl, kv.renew_interval, cap=self.startup_timeout), gone, self._config)

    def credential(self, role: str) -> str:
        """A credential of ``role`` (``worker``, ``client``, ``read-only``) for this cluster's token."""
        if self.keyring is None:
            raise InvalidArgument("this cluster runs without a token: there are no credentials")
        return self.keyring.credential(role)

    def client_config(self) -> Config:
        """The configuration a caller of this cluster needs (its TLS settings among them)."""
        return Config.load(None, self.config)

    def _write_manifest(self) -> None:
        """``DATA_DIR/cluster.json``: where client commands find the cluster (rewritten after restarts)."""
        tmp = self.data_dir / "cluster.json.tmp"
        tmp.write_text(json.dumps({
            "address": self.address,
            "gs_address": self.gs_address,
            "gs_pid": self.gs.pid if self.gs is not None else 0,
            "gs_addresses": self.gs_addresses,
            "workers": {w: {"address": h.address, "pid": h.pid} for w, h in self.workers.items()},
            "metrics_urls": self.metrics_urls,
            "pid": os.getpid(),
        }, indent=2))
        tmp.replace(self.data_dir / "cluster.json")

    def stop(self) -> None:
        """Stop every process (instances, workers, global stores), free the workers' shared memory and the
        data directory. Idempotent. The whole cluster stops: workers stop at once (SIGINT), without handing
        their KV shards to each other (SIGTERM, one worker's graceful stop, would)."""
        atexit.unregister(self.stop)
        for h in self.workers.values():
            h.interrupt()
        stop_handles(list(self.instances.values()) + list(self.workers.values()) + self.global_stores)
        for wid in self.workers:
            remove_stale_segments(self._worker_prefix(wid))
        if self.net is not None:
            self.net.close()
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # ----------------------------------------------------------------- processes
    def _common_env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.keyring is not None:  # the cluster's processes hold the worker credential, not the secret
            env["TENSORCAST_TOKEN"] = self.keyring.credential(WORKER)
        return env

    def _overrides(self) -> list[str]:
        return [f"--set={k}={v}" for k, v in self.config.items()]

    def _start_gs(self) -> None:
        store = [] if not self.etcd else [f"--set=gs.etcd_endpoints={self.etcd}",
                                          f"--set=gs.etcd_prefix={self.etcd_prefix}"]
        for i in range(self.n_global_stores):
            name = "gs" if i == 0 else f"gs{i}"
            ready = self.data_dir / f"{name}.ready"
            args = self._on_host(self.gs_host, [
                sys.executable, "-m", "tensorcast", "gs", "--data-dir", str(self.data_dir / name), "--port", "0",
                "--ready-file", str(ready), *store, *self._overrides(), *self._ports(i)])
            self.global_stores.append(ProcessHandle(name, args, ready, self.data_dir / "logs" / f"{name}.log",
                                                    host=self.gs_host))
        for h in self.global_stores:
            h.spawn(self._common_env())
        for h in self.global_stores:
            h.wait_ready(self.startup_timeout)
            self._keep_port(h)
        self.gs = self.global_stores[0]

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

    def add_worker(self, worker_id: str | None = None, host: int | None = None) -> str:
        """Start one more worker, configured as the others (default id: the first free ``wN``; default host:
        the next in turn); returns its id once it is ready and the KV shard table has settled again (it takes
        its share of the shards), with ``cluster.json`` rewritten."""
        if self.gs is None:
            raise InvalidArgument("the cluster is not started")
        if worker_id is None:
            worker_id = next(f"w{i}" for i in range(len(self.workers) + 1) if f"w{i}" not in self.workers)
        if worker_id in self.workers or not worker_id or "/" in worker_id:
            raise InvalidArgument(f"cannot add worker {worker_id!r}: taken or not a valid id; workers: "
                                  f"{list(self.workers)}")
        if host is not None and not 0 <= host < self.hosts:
            raise InvalidArgument(f"host {host}: this cluster has hosts 0..{self.hosts - 1}")
        handle = self._worker_handle(worker_id, self._created, host)
        self.workers[worker_id] = handle
        try:
            handle.spawn(self._common_env())
            handle.wait_ready(self.startup_timeout)
        except BaseException:
            stop_handles([self.workers.pop(worker_id)])
            remove_stale_segments(self._worker_prefix(worker_id))
            raise
        self._keep_port(handle)
        self._wait_settled()
        self._write_manifest()
        return worker_id

    def stop_worker(self, worker_id: str, timeout: float = STOP_TIMEOUT) -> int:
        """Stop a worker gracefully (SIGTERM: it drains, then exits) and forget it; returns its exit code (0
        for a clean stop). The KV shard table settles on the remaining homes before this returns."""
        handle = self._worker(worker_id)
        if len(self.workers) == 1:
            raise InvalidArgument(f"{worker_id} is the cluster's last worker: stop the cluster instead")
        handle.terminate()
        code = handle.wait_exit(timeout) if handle.popen is not None else 0
        handle.close_log()
        del self.workers[worker_id]
        remove_stale_segments(self._worker_prefix(worker_id))
        if any(h.alive() for h in self.workers.values()):
            self._wait_settled(gone=frozenset({worker_id}))
        self._write_manifest()
        return code

    # ----------------------------------------------------------------- fault hooks
    def _worker(self, worker_id: str) -> ProcessHandle:
        try:
            return self.workers[worker_id]
        except KeyError:
            raise InvalidArgument(f"no worker {worker_id!r}; workers: {list(self.workers)}") from None

    def free_segments(self, worker_id: str) -> int:
        """Unlink the shared-memory segments a dead worker left (callers that mapped them keep their pages);
        how many. Nothing while it runs."""
        return 0 if self._worker(worker_id).alive() else remove_stale_segments(self._worker_prefix(worker_id))

    def kill_worker(self, worker_id: str) -> None:
        """SIGKILL: the worker's memory replicas are lost."""
        h = self._worker(worker_id)
        if h.alive():
            assert h.popen is not None
            h.popen.kill()
            h.popen.wait()

    def restart_worker(self, worker_id: str) -> None:
        h = self._worker(worker_id)
        if h.alive():
            self.kill_worker(worker_id)
        h.spawn(self._common_env())
        h.wait_ready(self.startup_timeout)
        self._write_manifest()

    def pause_worker(self, worker_id: str) -> None:
        os.kill(self._worker(worker_id).pid, signal.SIGSTOP)

    def resume_worker(self, worker_id: str) -> None:
        os.kill(self._worker(worker_id).pid, signal.SIGCONT)

    def _global_store(self, index: int) -> ProcessHandle:
        if not 0 <= index < len(self.global_stores):
            raise InvalidArgument(f"no global store {index}; there are {len(self.global_stores)}")
        return self.global_stores[index]

    def kill_global_store(self, index: int = 0) -> None:
        """kill -9 a global store (the first by default)."""
        h = self._global_store(index)
        if h.alive():
            assert h.popen is not None
            h.popen.kill()
            h.popen.wait()

    def restart_global_store(self, index: int = 0) -> None:
        """kill -9 a global store and start it again on the same data directory (or etcd) and port."""
        self.kill_global_store(index)
        h = self._global_store(index)
        h.spawn(self._common_env())
        h.wait_ready(self.startup_timeout)
        self._write_manifest()

    def start_instance(self, instance_id: str, worker_id: str, args: list[str] | None = None,
                       module: str = "tensorcast.testing.hf_instance") -> ProcessHandle:
        """Start an instance process (by default a tiny HF Llama) attached to ``worker_id``; it is stopped
        with the cluster. ``args`` are extra command-line arguments of ``module``."""
        ready = self.data_dir / f"{instance_id}.ready"
        cmd = [sys.executable, "-m", module, "--worker", self._worker(worker_id).address, "--id", instance_id,
               "--ready-file", str(ready), *(args or [])]
        handle = ProcessHandle(instance_id, cmd, ready, self.data_dir / "logs" / f"{instance_id}.log")
        self.instances[instance_id] = handle
        env = self._common_env()
        if self._config.metrics.port:  # a fixed port from a configuration file is for the cluster's own processes
            env["TENSORCAST_METRICS_PORT"] = "0"
        handle.spawn(env)
        handle.wait_ready(self.startup_timeout)
        return handle

    def stop_instance(self, instance_id: str) -> None:
        stop_handles([self.instances.pop(instance_id)])

    def pids(self) -> dict[str, int]:
        out = {w: h.pid for w, h in [*self.workers.items(), *self.instances.items()] if h.popen is not None}
        for h in self.global_stores:
            if h.popen is not None:
                out[h.name] = h.pid
        return out
