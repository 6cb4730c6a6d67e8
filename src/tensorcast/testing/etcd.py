"""A real etcd cluster of N members on loopback, for tests and benchmarks (point ``tensorcast up --etcd`` at
its ``endpoints`` to try several global stores by hand).

Owns: starting ``etcd`` processes (Debian ``etcd-server``) with their own data directories and free ports,
waiting until the cluster is healthy, the fault hooks (kill -9 a member, restart it, find the leader) and
stopping every member. Elections are tuned fast (heartbeat 50 ms, election timeout 500 ms) so that a test
sees a new leader in about a second. Does not own: what is stored (``gs.etcd``).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from tensorcast.errors import Unavailable
from tensorcast.testing.tools import unused_port

__all__ = ["EtcdCluster", "etcd_binary"]


def etcd_binary() -> str | None:
    return shutil.which("etcd")


_START_ATTEMPTS = 4  # a port found free can be taken before etcd binds it: start again with new ones


class _PortTaken(Unavailable):
    """A member could not bind a port that was free when it was chosen."""


class EtcdCluster:
    def __init__(self, members: int = 3, data_dir: str | Path | None = None, *, startup_timeout: float = 30.0) -> None:
        binary = etcd_binary()
        if binary is None:
            raise Unavailable("etcd is not installed (Debian: apt-get install etcd-server)")
        self.binary = binary
        self._tmp = None if data_dir is not None else tempfile.TemporaryDirectory(prefix="tensorcast-etcd-")
        self.data_dir = Path(data_dir if data_dir is not None else self._tmp.name)  # type: ignore[union-attr]
        self.startup_timeout = startup_timeout
        self.names = [f"m{i}" for i in range(members)]
        self._pick_ports()
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * members

    def _pick_ports(self) -> None:
        self.client_ports = [unused_port() for _ in self.names]
        self.peer_ports = [unused_port() for _ in self.names]

    @property
    def urls(self) -> list[str]:
        """Every member's client URL."""
        return [f"http://127.0.0.1:{p}" for p in self.client_ports]

    @property
    def endpoints(self) -> str:
        return ",".join(self.urls)

    def __enter__(self) -> EtcdCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _args(self, i: int, state: str) -> list[str]:
        cluster = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip(self.names, self.peer_ports, strict=True))
        return [self.binary, "--name", self.names[i], "--data-dir", str(self.data_dir / self.names[i]),
                "--listen-client-urls", self.urls[i], "--advertise-client-urls", self.urls[i],
                "--listen-peer-urls", f"http://127.0.0.1:{self.peer_ports[i]}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_ports[i]}",
                "--initial-cluster", cluster, "--initial-cluster-state", state,
                "--initial-cluster-token", f"tensorcast-{id(self)}", "--heartbeat-interval", "50",
                "--election-timeout", "500", "--logger", "zap", "--log-outputs", "stderr"]

    def _spawn(self, i: int, state: str) -> None:
        log = (self.data_dir / f"{self.names[i]}.log").open("ab")
        self.procs[i] = subprocess.Popen(self._args(i, state), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        log.close()

    def start(self) -> None:
        for attempt in range(_START_ATTEMPTS):
            self.data_dir.mkdir(parents=True, exist_ok=True)
            try:
                for i in range(len(self.names)):
                    self._spawn(i, "new")
                self.wait_healthy()
                return
            except _PortTaken:
                self._stop_members()
                for name in self.names:  # a half-formed cluster must not be rejoined with new peer URLs
                    shutil.rmtree(self.data_dir / name, ignore_errors=True)
                    (self.data_dir / f"{name}.log").unlink(missing_ok=True)
                if attempt == _START_ATTEMPTS - 1:
                    self.stop()
                    raise
                self._pick_ports()
            except BaseException:
                self.stop()
                raise

    def healthy(self, i: int) -> bool:
        try:
            with urllib.request.urlopen(self.urls[i] + "/health", timeout=1) as r:
                return bool(json.loads(r.read()).get("health") == "true")
        except (OSError, ValueError):
            return False

    def wait_healthy(self, members: list[int] | None = None) -> None:
        deadline = time.monotonic() + self.startup_timeout
        want = members if members is not None else [i for i, p in enumerate(self.procs) if p is not None]
        while not all(self.healthy(i) for i in want):
            for i in want:
                proc = self.procs[i]
                if proc is not None and proc.poll() is not None:
                    tail = (self.data_dir / f"{self.names[i]}.log").read_text(errors="replace")[-2000:]
                    error = _PortTaken if "address already in use" in tail else Unavailable
                    raise error(f"etcd member {self.names[i]} exited:\n{tail}")
            if time.monotonic() > deadline:
                raise Unavailable(f"etcd not healthy after {self.startup_timeout}s (logs in {self.data_dir})")
            time.sleep(0.1)

    def kill(self, i: int) -> None:
        """kill -9 one member."""
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def restart(self, i: int) -> None:
        self.kill(i)
        self._spawn(i, "existing")
        self.wait_healthy([i])

    def leader(self) -> int:
        """Index of the member that leads now (asked of any live member)."""
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            ids: dict[str, int] = {}
            leader = ""
            for i, url in enumerate(self.urls):
                if self.procs[i] is None or self.procs[i].poll() is not None:  # type: ignore[union-attr]
                    continue
                with contextlib.suppress(OSError, ValueError, KeyError):
                    req = urllib.request.Request(url + "/v3/maintenance/status", data=b"{}", method="POST")
                    with urllib.request.urlopen(req, timeout=1) as r:
                        status = json.loads(r.read())
                    ids[status["header"]["member_id"]] = i
                    leader = status.get("leader", "") or leader
            if leader in ids:
                return ids[leader]
            time.sleep(0.1)
        raise Unavailable("no etcd leader")

    def stop(self) -> None:
        self._stop_members()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def _stop_members(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            if proc is not None:
                try:
                    proc.wait(timeout=2)  # a member whose peers are gone waits for them: no need here
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.procs = [None] * len(self.names)
