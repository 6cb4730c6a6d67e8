"""``tensorcast up`` as a user runs it, with real processes: it says when a worker or the global store dies,
restarts a dead worker with ``--restart-dead``, runs several global stores on an etcd cluster, and leaves no
process behind when stopped."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

import tensorcast as tc
from tensorcast.cluster_processes import KILL_GRACE, TERM_TIMEOUT
from tensorcast.testing.etcd import EtcdCluster
from tensorcast.wire.messages import GetArtifact


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is not alive
    except OSError:
        return False


class Up:
    """A ``tensorcast up`` process whose output lines are read on a thread, so that waits are bounded."""

    def __init__(self, data_dir: Path, *flags: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tensorcast", "up", "--workers", "2", "--data-dir",
                                      str(data_dir), *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=dict(os.environ, COLUMNS="250", **(env or {})))
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def expect(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first new output line matching ``pattern`` within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            self.seen.append(line)
            if m := re.search(pattern, line):
                return m
        raise AssertionError(f"no line matching {pattern!r} within {timeout}s; output so far: {self.seen}")

    def all_output(self) -> list[str]:
        """Every line, once the process has exited."""
        self.reader.join(timeout=10)
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return self.seen

    def pids(self) -> dict[str, int]:
        """The processes the banner names: ``{"gs": pid, "w0": pid, ...}``."""
        banner = self.expect(r"^processes: ", timeout=60).string
        return {name: int(pid) for name, pid in re.findall(r"(\w+) pid (\d+)", banner)}


@contextlib.contextmanager
def running_up(tmp_path: Path, *flags: str, env: dict[str, str] | None = None) -> Iterator[tuple[Up, dict[str, int]]]:
    """``up`` started and ready; on exit stopped with SIGINT, and every process it ran must be gone."""
    up = Up(tmp_path / "tc-data", *flags, env=env)
    pids: dict[str, int] = {}
    try:
        pids.update(up.pids())
        up.expect(r"^Ctrl-C to stop", timeout=10)
        yield up, pids
    finally:
        up.proc.send_signal(signal.SIGINT)
        try:  # up stops its processes one after the other, each given TERM_TIMEOUT, then KILL_GRACE once killed
            rc = up.proc.wait(timeout=(TERM_TIMEOUT + KILL_GRACE) * len(pids) + 10)
        except subprocess.TimeoutExpired:
            up.proc.kill()
            raise
        finally:
            for pid in pids.values():  # a failing test must not leave its cluster running either
                with contextlib.suppress(ProcessLookupError):
                    if _alive(pid):
                        os.kill(pid, signal.SIGKILL)
    assert rc == 0, up.seen
    assert not [p for p in pids.values() if _alive(p)]


def test_up_says_when_a_worker_or_the_global_store_dies(tmp_path: Path) -> None:
    with running_up(tmp_path) as (up, pids):
        workers = json.loads((tmp_path / "tc-data" / "cluster.json").read_text())["workers"]
        assert {w: info["pid"] for w, info in workers.items()} == {w: pids[w] for w in ("w0", "w1")}
        os.kill(pids["w1"], signal.SIGKILL)
        up.expect(rf"^worker w1 \(pid {pids['w1']}\) died: killed by SIGKILL; log: .*/logs/w1\.log$", timeout=5)
        os.kill(pids["gs"], signal.SIGKILL)
        up.expect(rf"^global store \(pid {pids['gs']}\) died: killed by SIGKILL; log: .*/logs/gs\.log$",
                  timeout=5)
        time.sleep(1.5)  # at least one more look at the processes
    assert len([line for line in up.all_output() if "died" in line]) == 2  # each death is said once


def test_up_restarts_dead_processes_with_restart_dead(tmp_path: Path, cli_anywhere: Any) -> None:
    with running_up(tmp_path, "--restart-dead") as (up, pids):
        address = json.loads((tmp_path / "tc-data" / "cluster.json").read_text())["workers"]["w1"]["address"]
        os.kill(pids["w1"], signal.SIGKILL)
        up.expect(rf"^worker w1 \(pid {pids['w1']}\) died: killed by SIGKILL", timeout=5)
        new_pid = int(up.expect(rf"^restarted worker w1: pid (\d+), address {address}$", timeout=30)[1])
        pids["w1 (restarted)"] = new_pid
        assert new_pid != pids["w1"] and _alive(new_pid)
        # The new process answers: the global store lists w1 alive under its new pid.
        row = rf"\bw1\b\W+{new_pid}\b.*\byes\b"
        deadline = time.monotonic() + 10
        while not re.search(row, (status := cli_anywhere("status", "--address", address)).stdout):
            assert time.monotonic() < deadline, status.stdout + status.stderr
            time.sleep(0.5)
        os.kill(pids["gs"], signal.SIGKILL)
        up.expect(rf"^global store \(pid {pids['gs']}\) died: killed by SIGKILL", timeout=5)
        pids["gs (restarted)"] = int(up.expect(r"^restarted global store: pid (\d+)", timeout=30)[1])
        assert _alive(pids["gs (restarted)"])


def test_up_gives_every_process_its_config_file(tmp_path: Path) -> None:
    (tmp_path / "tc.toml").write_text('[worker]\nmemory_capacity = "300MiB"\n')
    with running_up(tmp_path, "--config", str(tmp_path / "tc.toml")) as (_up, _pids):
        address = json.loads((tmp_path / "tc-data" / "cluster.json").read_text())["workers"]["w0"]["address"]
        with tc.connect(address) as client:
            assert {w.memory_capacity for w in client.list_workers()} == {300 << 20}


def test_up_runs_two_global_stores_on_etcd(tmp_path: Path, etcd_cluster: EtcdCluster, cli_anywhere: Any) -> None:
    with running_up(tmp_path, "--etcd", etcd_cluster.endpoints, "--global-stores", "2") as (up, pids):
        assert {"gs", "gs1", "w0", "w1"} <= set(pids)
        manifest = json.loads((tmp_path / "tc-data" / "cluster.json").read_text())
        stores = manifest["gs_addresses"]
        assert len(set(stores)) == 2
        banner = next(line for line in up.seen if line.startswith("TensorCast cluster up"))
        assert all(a in banner for a in stores) and etcd_cluster.endpoints in banner
        # Both stores are listed to a user: the one answering as "gs", the other as "gs@ADDRESS" (each says it
        # is alive in etcd a few times per liveness timeout, so the second may take a moment to appear).
        deadline = time.monotonic() + 3 * tc.Config().gs.worker_liveness_timeout  # it announces every third
        while True:
            status = cli_anywhere("status", "--json", "--address", manifest["address"])
            assert status.returncode == 0, status.stderr
            urls = json.loads(status.stdout)["metrics_urls"]
            named = {name for name in urls if name.startswith("gs")}
            if len(named) == 2:
                break
            assert time.monotonic() < deadline, urls
            time.sleep(0.5)
        assert "gs" in named and any(f"gs@{a}" in named for a in stores)

        data = np.random.default_rng(5).random((64, 64), dtype=np.float32)
        with tc.connect(manifest["address"]) as client:
            art = client.put({"x": data}, key="up/etcd")
            assert np.array_equal(client.artifact("up/etcd").tensor("x", like="numpy"), data)
            # The metadata is on etcd, not in one process: each global store answers for the key.
            for address in stores:
                reply = client._run(client.aio.caller.call(GetArtifact(key_or_id="up/etcd"),
                                                           address=address))
                assert reply.artifact.id == art.id, address


def _shm_files(up_pid: int) -> list[str]:
    """The /dev/shm files of the cluster an ``up`` (pid ``up_pid``) runs: LocalCluster names them tc<pid>x..."""
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"tc{up_pid}x")]


def test_sighup_stops_up_cleanly_like_ctrl_c(tmp_path: Path) -> None:
    """Closing the terminal sends SIGHUP: up once died of it, leaving its processes and /dev/shm behind."""
    up = Up(tmp_path / "tc-data")
    pids = up.pids()
    try:
        up.expect(r"^Ctrl-C to stop", timeout=10)
        address = json.loads((tmp_path / "tc-data" / "cluster.json").read_text())["address"]
        with tc.connect(address) as client:  # something in shared memory
            client.put({"x": np.ones(1 << 20, np.float32)}, key="up/hup")
        assert _shm_files(up.proc.pid)
        up.proc.send_signal(signal.SIGHUP)
        assert up.proc.wait(timeout=30) == 0
        assert "stopping..." in up.all_output()
        deadline = time.monotonic() + 10
        while [p for p in pids.values() if _alive(p)] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids.values() if _alive(p)]
        assert not _shm_files(up.proc.pid)
    finally:
        for pid in [up.proc.pid, *pids.values()]:
            with contextlib.suppress(ProcessLookupError):
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)


def test_a_second_up_on_the_same_data_dir_is_refused_and_the_first_keeps_everything(tmp_path: Path,
                                                                                    cli_anywhere: Any) -> None:
    with running_up(tmp_path) as (up, pids):
        manifest = (tmp_path / "tc-data" / "cluster.json").read_text()
        address = json.loads(manifest)["address"]
        x = np.arange(1 << 16, dtype=np.float32)
        with tc.connect(address) as client:
            client.put({"x": x}, key="up/first")  # in memory only: a second up's workers once wiped it
        r = cli_anywhere("up", "--workers", "2", "--data-dir", str(tmp_path / "tc-data"), timeout=60)
        cli_anywhere.assert_one_line_error(r, "in use", f"pid {up.proc.pid}", "tensorcast up", address)
        assert (tmp_path / "tc-data" / "cluster.json").read_text() == manifest
        assert all(_alive(p) for p in pids.values())
        with tc.connect(address) as client:
            assert np.array_equal(client.artifact("up/first").tensor("x", like="numpy"), x)
            assert {w.worker_id: w.pid for w in client.list_workers() if w.alive} == \
                {w: pids[w] for w in ("w0", "w1")}


def test_add_worker_and_stop_worker_on_a_running_up(tmp_path: Path, cli_anywhere: Any) -> None:
    data_dir = str(tmp_path / "tc-data")
    cli_anywhere.assert_one_line_error(cli_anywhere("add-worker", "--data-dir", data_dir), "no `tensorcast up`")
    with running_up(tmp_path) as (up, pids):
        r = cli_anywhere("add-worker", "--data-dir", data_dir, timeout=120)
        assert r.returncode == 0, r.stderr
        m = re.fullmatch(r"added worker w2: pid (\d+), address (\S+)", r.stdout.strip())
        assert m, r.stdout
        pids["w2"] = int(m[1])
        up.expect(rf"^added worker w2: pid {m[1]}, address {re.escape(m[2])}$", timeout=10)
        manifest = json.loads((tmp_path / "tc-data" / "cluster.json").read_text())
        assert manifest["workers"]["w2"] == {"address": m[2], "pid": int(m[1])}
        assert (tmp_path / "tc-data" / "workers" / "w2" / "owner.lock").exists()  # its own data directory
        with tc.connect(m[2]) as client:
            assert {w.worker_id for w in client.list_workers() if w.alive} == {"w0", "w1", "w2"}
            client.put({"x": np.arange(10)}, key="up/via-w2", on="w2")
            assert np.array_equal(client.artifact("up/via-w2").tensor("x", like="numpy"), np.arange(10))
        taken = cli_anywhere("add-worker", "--id", "w0", "--data-dir", data_dir, timeout=60)
        cli_anywhere.assert_one_line_error(taken, "w0", "taken")
        r = cli_anywhere("stop-worker", "w2", "--data-dir", data_dir, timeout=120)
        assert r.returncode == 0 and r.stdout.strip() == "stopped worker w2 (exit code 0)", r.stdout + r.stderr
        assert not _alive(pids["w2"])
        assert "w2" not in json.loads((tmp_path / "tc-data" / "cluster.json").read_text())["workers"]
        time.sleep(1.5)  # at least one more look at the processes: a stopped worker is not a death
    assert not [line for line in up.all_output() if "died" in line]


def test_up_banner_states_the_pre_faulted_memory(tmp_path: Path) -> None:
    with running_up(tmp_path, "--memory", "1GiB") as (up, _pids):
        line = next(line for line in up.seen if line.startswith("each worker:"))
        assert "1.0 GiB memory tier" in line and "512.0 MiB of shared memory pre-faulted once idle" in line, line


def test_up_gives_each_process_its_own_metrics_port_from_a_fixed_base(tmp_path: Path) -> None:
    from tensorcast.testing.tools import unused_ports

    base = unused_ports(3)
    with running_up(tmp_path, "--set", f"metrics.port={base}") as (_up, _pids):
        urls = json.loads((tmp_path / "tc-data" / "cluster.json").read_text())["metrics_urls"]
        assert {name: int(url.rsplit(":", 1)[1]) for name, url in urls.items()} == \
            {"gs": base, "w0": base + 1, "w1": base + 2}


def test_up_with_a_port_in_use_or_an_unwritable_data_dir_is_a_one_line_error(tmp_path: Path,
                                                                               cli_anywhere: Any) -> None:
    import socket

    from tensorcast.testing.tools import unused_port

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", unused_port()))
        squatter.listen()
        port = squatter.getsockname()[1]
        r = cli_anywhere("up", "--data-dir", str(tmp_path / "d"), "--set", f"metrics.port={port}", timeout=120)
        cli_anywhere.assert_one_line_error(r, "gs", "cannot listen", "in use", str(port))
        r = cli_anywhere("gs", "--data-dir", str(tmp_path / "g"), "--port", str(port), timeout=60)
        cli_anywhere.assert_one_line_error(r, "cannot listen", "in use", str(port))
    assert not (tmp_path / "d" / "gs.ready").exists()
    # root ignores permission bits, and sysfs refuses new files even to root.
    unwritable = Path("/sys/tc-data") if os.geteuid() == 0 else tmp_path / "read-only" / "tc-data"
    if os.geteuid() != 0:
        unwritable.parent.mkdir()
        unwritable.parent.chmod(0o555)
    for command in ("up", "gs"):
        r = cli_anywhere(command, "--data-dir", str(unwritable), timeout=60)
        cli_anywhere.assert_one_line_error(r, "INVALID_ARGUMENT", str(unwritable), "cannot")


def test_up_frees_the_shared_memory_of_a_worker_killed_for_good(tmp_path: Path) -> None:
    with running_up(tmp_path) as (up, pids):
        address = json.loads((tmp_path / "tc-data" / "cluster.json").read_text())["address"]
        with tc.connect(address) as client:
            client.put({"x": np.ones(1 << 20, np.float32)}, key="up/on-w1", on="w1")
        mine = [name for name in _shm_files(up.proc.pid) if "-w1-" in name]
        assert mine
        os.kill(pids["w1"], signal.SIGKILL)  # it cannot unlink its segments itself
        up.expect(r"^worker w1 \(pid \d+\) died: killed by SIGKILL", timeout=5)
        up.expect(r"^freed \d+ shared-memory segments of worker w1$", timeout=5)
        assert not [name for name in _shm_files(up.proc.pid) if "-w1-" in name]


def test_a_tokenless_up_says_it_is_open_to_every_local_user(tmp_path: Path) -> None:
    with running_up(tmp_path) as (up, _pids):
        assert any("open to every local user" in line for line in up.seen), up.seen


def test_up_with_a_secret_and_tls_prints_a_client_credential(tmp_path: Path, cli_anywhere: Any) -> None:
    secret = "up-secret"
    with running_up(tmp_path, "--tls", env={"TENSORCAST_TOKEN": secret}) as (up, _pids):
        credential = next(m[1] for line in up.seen if (m := re.search(r"export TENSORCAST_TOKEN=(client:\w+)", line)))
        tls = next(m for line in up.seen if (m := re.search(r"TENSORCAST_TLS_ENABLED=true TENSORCAST_TLS_CA_FILE=(\S+)",
                                                           line)))
        assert not any(secret in line for line in up.seen)  # the secret itself is never printed
        env = {"TENSORCAST_TOKEN": credential, "TENSORCAST_TLS_ENABLED": "true", "TENSORCAST_TLS_CA_FILE": tls[1]}
        listing = cli_anywhere("ls", "--data-dir", str(tmp_path / "tc-data"), env=env)
        assert listing.returncode == 0, listing.stderr
        read_only = cli_anywhere("credential", "--role", "read-only", env={"TENSORCAST_TOKEN": secret}).stdout.strip()
        assert read_only.startswith("read-only:")
        status = cli_anywhere("status", "--data-dir", str(tmp_path / "tc-data"),
                              env={**env, "TENSORCAST_TOKEN": read_only})
        assert status.returncode == 0 and "w0" in status.stdout, status.stderr
        plain = cli_anywhere("ls", "--data-dir", str(tmp_path / "tc-data"), env={"TENSORCAST_TOKEN": credential})
        assert plain.returncode == 2 and "TLS" in plain.stderr, plain.stderr
