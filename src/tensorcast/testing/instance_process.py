"""The life of a test or demo instance process once its engine is served: announce readiness, wait for a
signal (or its parent's end), stop.

Owns: the ready file a ``LocalCluster`` waits on (written whole, then renamed into place, so a reader never
sees half of it) and the SIGTERM/SIGINT wait. Does not own: the engine or how it is served
(``tensorcast.instance.serve``).
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

from tensorcast.instance.runtime import InstanceRuntime
from tensorcast.lifetime import follow_parent

__all__ = ["run_until_signalled"]


def run_until_signalled(runtime: InstanceRuntime, instance_id: str, ready_file: str) -> None:
    """Write ``ready_file`` for ``runtime``, serve until SIGTERM, SIGINT or SIGHUP (or the end of the
    ``LocalCluster`` that started it), then stop it."""
    stop = threading.Event()  # handlers first: a stop that follows the ready file at once still stops cleanly
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    follow_parent(stop.set)  # started by a LocalCluster: it ends with it
    tmp = Path(ready_file).with_suffix(".tmp")
    tmp.write_text(json.dumps({"instance_id": instance_id, "address": runtime.address, "pid": os.getpid(),
                               "home_worker": runtime.home_worker, "metrics_url": runtime.metrics_url}))
    tmp.replace(ready_file)
    stop.wait()
    runtime.stop()
