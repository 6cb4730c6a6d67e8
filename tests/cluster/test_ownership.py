"""What a cluster owns, with real processes: its data directory (one cluster at a time, a second refused naming
the first, which keeps everything), its processes (they end with the script that started them, however it
ends) and its shared memory (a worker killed with kill -9 leaves segments that the next worker on its data
directory frees)."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import tensorcast as tc
from tensorcast.errors import InvalidArgument
from tensorcast.lifetime import WATCH_INTERVAL
from tensorcast.pool.segments import SHM_DIR
from tensorcast.testing import running_cluster
from tensorcast.worker.datadir import pid_alive

# A script that starts a cluster on DATA_DIR, puts 4 MiB into w0's memory, prints what the test needs, and then
# either returns without stop() ("exit") or waits to be killed ("wait").
SCRIPT = """
import json, sys, time
import numpy as np
import tensorcast as tc

cluster = tc.LocalCluster(workers=int(sys.argv[3]), data_dir=sys.argv[1], config={"worker.prefault_bytes": 0})
cluster.start()
with tc.connect(cluster.address) as client:
    client.put({"x": np.ones(1 << 20, np.float32)}, key="own/x", on="w0")
print(json.dumps({"pids": cluster.pids(), "shm_prefix": cluster.shm_prefix}), flush=True)
if sys.argv[2] == "wait":
    time.sleep(600)
"""


def _script(tmp_path: Path, data_dir: Path, mode: str, workers: int = 2) -> tuple[subprocess.Popen[str], dict]:
    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    proc = subprocess.Popen([sys.executable, str(path), str(data_dir), mode, str(workers)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"the script ended early (code {proc.wait()})"
    return proc, json.loads(line)


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still alive after ``timeout`` seconds (none, once they have all ended)."""
    deadline = time.monotonic() + timeout
    while (alive := [p for p in pids if pid_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def _segments(prefix: str) -> list[str]:
    return sorted(glob.glob(os.path.join(SHM_DIR, glob.escape(prefix) + "-*")))


def test_a_second_cluster_on_a_data_directory_is_refused_and_the_first_keeps_everything(tmp_path: Path) -> None:
    data_dir = tmp_path / "tc-data"
    with running_cluster(workers=2, data_dir=data_dir) as first, tc.connect(first.address) as client:
        x = np.arange(1 << 16, dtype=np.float32)
        client.put({"x": x}, key="own/first")  # in memory only: a second cluster's workers once wiped it
        manifest = (data_dir / "cluster.json").read_text()
        pids = first.pids()
        second = tc.LocalCluster(workers=2, data_dir=data_dir)
        with pytest.raises(InvalidArgument) as refused:
            second.start()
        message = refused.value.message
        assert "in use" in message and f"pid {os.getpid()}" in message and first.address in message, message
        assert "\n" not in message
        assert (data_dir / "cluster.json").read_text() == manifest
        assert first.pids() == pids and all(pid_alive(p) for p in pids.values())
        assert np.array_equal(client.artifact("own/first").tensor("x", like="numpy"), x)
        assert {(w.worker_id, w.pid, w.alive) for w in client.list_workers()} == \
            {(w, pids[w], True) for w in ("w0", "w1")}


def test_a_second_global_store_or_worker_on_a_held_directory_is_a_one_line_error(tmp_path: Path) -> None:
    data_dir = tmp_path / "tc-data"
    with running_cluster(workers=1, data_dir=data_dir) as cluster:
        runs = {
            "gs": ["gs", "--data-dir", str(data_dir / "gs"), "--port", "0"],
            "w0": ["worker", "--gs", cluster.gs_address, "--id", "w0", "--data-dir", str(data_dir / "workers" / "w0")],
        }
        for name, args in runs.items():
            r = subprocess.run([sys.executable, "-m", "tensorcast", *args], capture_output=True, text=True, timeout=60)
            lines = r.stderr.strip().splitlines()
            assert r.returncode == 2 and len(lines) == 1 and "in use" in lines[0], (name, r.stderr)
            assert f"pid {cluster.pids()[name]}" in lines[0], lines[0]
        with tc.connect(cluster.address) as client:
            assert [w.alive for w in client.list_workers()] == [True]


def test_a_cluster_whose_script_returns_without_stop_leaves_nothing_running(tmp_path: Path) -> None:
    proc, out = _script(tmp_path, tmp_path / "tc-data", "exit")
    assert proc.wait(timeout=60) == 0
    # The script's own exit stopped its cluster (atexit): nothing to wait for.
    assert not _wait_gone(list(out["pids"].values()), timeout=1.0)
    assert not glob.glob(os.path.join(SHM_DIR, glob.escape(out["shm_prefix"]) + "*"))


def test_the_processes_of_a_killed_script_end_with_it(tmp_path: Path) -> None:
    proc, out = _script(tmp_path, tmp_path / "tc-data", "wait")
    pids = list(out["pids"].values())
    proc.kill()  # no atexit, no stop(): only the children themselves can notice
    proc.wait(timeout=10)
    assert not _wait_gone(pids, timeout=30), "processes outlived the script that started them"
    # They stopped cleanly (SIGTERM at their parent's death): each worker unlinked its own segments.
    assert not glob.glob(os.path.join(SHM_DIR, glob.escape(out["shm_prefix"]) + "*"))


def test_a_new_worker_frees_the_segments_its_killed_predecessor_left(tmp_path: Path) -> None:
    data_dir = tmp_path / "tc-data"
    proc, out = _script(tmp_path, data_dir, "wait", workers=1)
    w0 = out["pids"]["w0"]
    stale = _segments(f"{out['shm_prefix']}-w0")
    assert stale, "w0 holds the put in shared memory"
    os.kill(w0, signal.SIGKILL)  # it cannot clean up
    assert not _wait_gone([w0], timeout=10)
    proc.kill()
    proc.wait(timeout=10)
    assert not _wait_gone(list(out["pids"].values()), timeout=30)
    assert all(os.path.exists(p) for p in stale), "nothing else frees a killed worker's segments"
    with running_cluster(workers=1, data_dir=data_dir) as again:
        assert again.shm_prefix != out["shm_prefix"]
        assert not [p for p in stale if os.path.exists(p)], "the new w0 freed its predecessor's segments"
        with tc.connect(again.address) as client:
            assert [w.alive for w in client.list_workers()] == [True]


def test_a_worker_restarted_from_a_short_lived_thread_outlives_the_thread() -> None:
    """The kernel's parent-death signal follows the thread that started a child: a child started from another
    thread must not be stopped when that thread ends."""
    with running_cluster(workers=1) as cluster:
        thread = threading.Thread(target=cluster.restart_worker, args=("w0",))
        thread.start()
        thread.join()
        pid = cluster.workers["w0"].pid
        time.sleep(4 * WATCH_INTERVAL)  # the signal would come at once; the watch looks every WATCH_INTERVAL
        assert pid_alive(pid)
        with tc.connect(cluster.address) as client:
            assert [(w.pid, w.alive) for w in client.list_workers()] == [(pid, True)]
