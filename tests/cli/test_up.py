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
from tensorcast.testing.etcd import EtcdCluster
from tensorcast.wire.messages import ArtifactReply, GetArtifact


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is not alive
    except OSError:
        return False


class Up:
    """A ``tensorcast up`` process whose output lines are read on a thread, so that waits are bounded."""

    def __init__(self, data_dir: Path, *flags: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tensorcast", "up", "--workers", "2", "--data-dir",
                                      str(data_dir), *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=dict(os.environ, COLUMNS="250"))
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
def running_up(tmp_path: Path, *flags: str) -> Iterator[tuple[Up, dict[str, int]]]:
    """``up`` started and ready; on exit stopped with SIGINT, and every process it ran must be gone."""
    up = Up(tmp_path / "tc-data", *flags)
    pids: dict[str, int] = {}
    try:
        pids.update(up.pids())
        up.expect(r"^Ctrl-C to stop", timeout=10)
        yield up, pids
    finally:
        up.proc.send_signal(signal.SIGINT)
        try:
            rc = up.proc.wait(timeout=30)
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
                reply = client._run(client.aio.caller.call(GetArtifact(key_or_id="up/etcd"), ArtifactReply,
                                                           address=address))
                assert reply.artifact.id == art.id, address
