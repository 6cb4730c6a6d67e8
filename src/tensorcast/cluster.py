"""``LocalCluster``: a global store and N workers as separate processes on loopback.

Owns: running a cluster: starting its processes and returning once the KV shard table has settled, adding and
stopping workers while it runs, the data directory's lock (one cluster at a time), writing ``cluster.json``,
stopping everything (also at interpreter exit), instance processes, and the fault hooks tests and demos use
(kill -9, restart, SIGSTOP/SIGCONT, restart of the global store on the same data directory and port). Does not
own: which processes a cluster has and their arguments (data directories, shared-memory prefix, ports:
``cluster_layout``), the mechanics of one process (spawning it to die with this one, its ready file, its
start-up failure in one line: ``cluster_processes``), or what the processes do.
"""

from __future__ import annotations

import atexit
import json
import os
import signal

from tensorcast.certs import cluster_tls
from tensorcast.cluster_layout import ClusterLayout
from tensorcast.cluster_processes import STOP_TIMEOUT, ProcessHandle, settle_timeout, stop_handles, wait_settled
from tensorcast.config import Config
from tensorcast.errors import InvalidArgument
from tensorcast.lockfile import DirLock
from tensorcast.pool.segments import remove_stale_segments

__all__ = ["LocalCluster", "ProcessHandle"]


class LocalCluster(ClusterLayout):
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

    _lock: DirLock | None = None  # the data directory's, from start() to stop()

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

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
    def _start_gs(self) -> None:
        self.global_stores.extend(self._gs_handle(i) for i in range(self.n_global_stores))
        for h in self.global_stores:
            h.spawn(self._common_env())
        for h in self.global_stores:
            h.wait_ready(self.startup_timeout)
            self._keep_port(h)
        self.gs = self.global_stores[0]

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
        handle = self._instance_handle(instance_id, worker_id, args, module)
        self.instances[instance_id] = handle
        handle.spawn(self._instance_env())
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
