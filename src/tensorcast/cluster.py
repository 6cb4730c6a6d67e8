"""``LocalCluster``: a global store and N workers as separate processes on loopback.

Owns: starting and stopping those processes (by PID), waiting for their ready files, writing
``cluster.json``, and the fault hooks tests and demos use (kill -9, restart, SIGSTOP/SIGCONT, restart of
the global store on the same data directory and port). Does not own: what the processes do.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tensorcast.config import default_host_id
from tensorcast.errors import InvalidArgument, Unavailable
from tensorcast.netns import Hosts
from tensorcast.pool.segments import remove_stale_segments

__all__ = ["LocalCluster", "ProcessHandle"]


@dataclass
class ProcessHandle:
    name: str
    args: list[str]
    ready_file: Path
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    info: dict[str, Any] | None = None

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    @property
    def address(self) -> str:
        assert self.info is not None
        return str(self.info["address"])

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


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
        self.memory_capacity = memory_capacity
        self.disk_capacity = disk_capacity
        self.roles = roles
        self.config = dict(config or {})
        self.startup_timeout = startup_timeout
        self.gs: ProcessHandle | None = None  # the first global store
        self.global_stores: list[ProcessHandle] = []
        self.workers: dict[str, ProcessHandle] = {}
        self.instances: dict[str, ProcessHandle] = {}
        self._logs: list[IO[bytes]] = []
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
        return list(self.workers).index(self._worker(worker_id).name) % self.hosts

    def _on_host(self, host: int, args: list[str]) -> list[str]:
        """``args`` run on ``host`` (in its namespace, bound to its address), or as they are."""
        if self.net is None:
            return args
        return [*self.net.exec_args(host), *args, "--host", self.net.address(host)]

    def start(self) -> None:
        (self.data_dir / "logs").mkdir(parents=True, exist_ok=True)
        try:
            if self.net is not None:
                self.net.start()
            self._start_gs()
            for i in range(self.n_workers):
                wid = f"w{i}"
                self.workers[wid] = self._worker_handle(wid, i)
            for handle in self.workers.values():
                self._spawn(handle)
            for handle in self.workers.values():
                self._wait_ready(handle)
                self._keep_port(handle)
        except BaseException:
            self.stop()
            raise
        self._write_manifest()

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
        }, indent=2))
        tmp.replace(self.data_dir / "cluster.json")

    def stop(self) -> None:
        handles = list(self.instances.values()) + list(self.workers.values()) + self.global_stores
        for h in handles:
            if h.alive():
                assert h.popen is not None
                with contextlib.suppress(ProcessLookupError):
                    os.kill(h.pid, signal.SIGCONT)
                h.popen.terminate()
        for h in handles:
            if h.popen is not None:
                try:
                    h.popen.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    h.popen.kill()
                    h.popen.wait(timeout=10)
        for wid in self.workers:
            remove_stale_segments(self._worker_prefix(wid))
        for f in self._logs:
            f.close()
        self._logs.clear()
        if self.net is not None:
            self.net.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # ----------------------------------------------------------------- processes
    def _common_env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.token is not None:
            env["TENSORCAST_TOKEN"] = self.token
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
                "--ready-file", str(ready), *store, *self._overrides()])
            self.global_stores.append(ProcessHandle(name, args, ready, self.data_dir / "logs" / f"{name}.log"))
        for h in self.global_stores:
            self._spawn(h)
        for h in self.global_stores:
            self._wait_ready(h)
            self._keep_port(h)
        self.gs = self.global_stores[0]

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

    def _worker_handle(self, wid: str, index: int) -> ProcessHandle:
        assert self.gs is not None
        ready = self.data_dir / f"{wid}.ready"
        args = self._on_host(index % self.hosts, [
            sys.executable, "-m", "tensorcast", "worker", "--gs", ",".join(self.gs_addresses), "--id", wid,
            "--port", "0", "--ready-file", str(ready), "--roles", ",".join(self.roles),
            "--host-id", self.host_id_of(index), f"--set=worker.shm_prefix={self.shm_prefix}",
            f"--set=worker.disk_dir={self.data_dir / 'workers' / wid / 'disk'}", *self._overrides()])
        if self.memory_capacity is not None:
            args += ["--memory", str(self.memory_capacity)]
        if self.disk_capacity is not None:
            args.append(f"--set=worker.disk_capacity={self.disk_capacity}")
        return ProcessHandle(wid, args, ready, self.data_dir / "logs" / f"{wid}.log")

    def _spawn(self, handle: ProcessHandle) -> None:
        handle.ready_file.unlink(missing_ok=True)
        handle.info = None
        log = open(handle.log_path, "ab")  # noqa: SIM115 - kept open for the child's lifetime
        self._logs.append(log)
        handle.popen = subprocess.Popen(handle.args, stdout=log, stderr=subprocess.STDOUT, env=self._common_env(),
                                        stdin=subprocess.DEVNULL)

    def _wait_ready(self, handle: ProcessHandle) -> None:
        deadline = time.time() + self.startup_timeout
        while time.time() < deadline:
            if handle.ready_file.exists():
                handle.info = json.loads(handle.ready_file.read_text())
                return
            if not handle.alive():
                tail = handle.log_path.read_text(errors="replace")[-2000:]
                raise Unavailable(f"{handle.name} exited during start-up:\n{tail}")
            time.sleep(0.02)
        raise Unavailable(f"{handle.name} not ready after {self.startup_timeout}s (log: {handle.log_path})")

    # ----------------------------------------------------------------- fault hooks
    def _worker(self, worker_id: str) -> ProcessHandle:
        try:
            return self.workers[worker_id]
        except KeyError:
            raise InvalidArgument(f"no worker {worker_id!r}; workers: {list(self.workers)}") from None

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
        self._spawn(h)
        self._wait_ready(h)
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
        self._spawn(h)
        self._wait_ready(h)
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
        self._spawn(handle)
        self._wait_ready(handle)
        return handle

    def stop_instance(self, instance_id: str) -> None:
        h = self.instances.pop(instance_id)
        if h.alive():
            assert h.popen is not None
            h.popen.terminate()
            h.popen.wait(timeout=10)

    def pids(self) -> dict[str, int]:
        out = {w: h.pid for w, h in [*self.workers.items(), *self.instances.items()] if h.popen is not None}
        for h in self.global_stores:
            if h.popen is not None:
                out[h.name] = h.pid
        return out
