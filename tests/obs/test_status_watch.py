"""``tensorcast status --watch`` redraws the dashboard's view until interrupted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import tensorcast as tc
from tensorcast.cluster import LocalCluster

INTERVAL = 0.2


def test_watch_follows_the_cluster(shared_cluster: LocalCluster, client: tc.Client, tmp_path: Path) -> None:
    # Into a file (a pipe nobody reads would fill up and stop it): without a terminal, one frame per interval.
    with (tmp_path / "out").open("w") as out_file:
        proc = subprocess.Popen([sys.executable, "-m", "tensorcast", "status", "--watch", "--interval",
                                 str(INTERVAL), "--address", shared_cluster.address], stdout=out_file,
                                stderr=subprocess.PIPE, text=True, env=dict(os.environ, COLUMNS="220"))
        try:
            time.sleep(20 * INTERVAL)  # running (and drawing) before the artifact exists
            before = (tmp_path / "out").read_text()
            art = client.put({"w": np.ones(1000, np.float32)}, key="watched-prefix/x")
            time.sleep(20 * INTERVAL)  # several redraws after it
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
    client.delete(art.id)
    out = (tmp_path / "out").read_text()
    assert proc.returncode == 0, err
    assert before.count("dashboard http://") >= 2  # frames while it ran, not only at the end
    assert "watched-prefix/" not in before and "watched-prefix/" in out  # a later frame shows the put
    assert all(w in out for w in shared_cluster.worker_ids)
