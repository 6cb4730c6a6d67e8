"""``tensorcast status --watch`` redraws the dashboard's view until interrupted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np

import tensorcast as tc
from tensorcast.cluster import LocalCluster

INTERVAL = 0.2


def test_watch_follows_the_cluster(shared_cluster: LocalCluster, client: tc.Client) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "tensorcast", "status", "--watch", "--interval", str(INTERVAL),
                             "--address", shared_cluster.address], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, COLUMNS="220"))
    try:
        time.sleep(20 * INTERVAL)  # running (and drawing) before the artifact exists
        art = client.put({"w": np.ones(1000, np.float32)}, key="watched-prefix/x")
        time.sleep(20 * INTERVAL)  # several redraws after it
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    client.delete(art.id)
    assert proc.returncode == 0, err
    # Without a terminal, the last frame is what is printed: it shows the artifact put while it was running.
    assert "watched-prefix/" in out and "dashboard http://" in out
    assert all(w in out for w in shared_cluster.worker_ids)
