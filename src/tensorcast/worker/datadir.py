"""A worker's data directory (``worker.data_dir``): one worker owns it at a time, and a starting worker frees
the shared memory its dead predecessor left behind.

Owns: taking the directory's lock (``lockfile``) for the life of the worker process, with the worker's id and
the prefix of its shared-memory segment names recorded in it; and, before the new worker creates any segment,
unlinking the segments named with the prefix the previous holder recorded, when that holder's process is dead
(killed with kill -9 it could not clean up, and ``tensorcast up`` gives each cluster a new prefix, so nothing
else would ever reclaim them). Callers that mapped those segments keep their pages; only the names go. Does
not own: the disk tier (its files are durable data, kept), or naming segments (``pool``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from tensorcast.lockfile import DirLock
from tensorcast.pool.segments import SHM_DIR, remove_stale_segments

__all__ = ["claim_data_dir", "pid_alive"]

log = logging.getLogger("tensorcast.worker")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def claim_data_dir(data_dir: str | os.PathLike[str], worker_id: str, shm_prefix: str,
                   shm_dir: str = SHM_DIR) -> DirLock:
    """Lock ``data_dir`` for worker ``worker_id`` (whose segments are named ``shm_prefix-...``), after freeing
    the segments of a dead predecessor. Raises ``InvalidArgument`` naming the holder when a live process has it."""
    lock = DirLock.acquire(Path(data_dir), f"worker {worker_id}'s data directory", worker_id=worker_id,
                           shm_prefix=shm_prefix)
    previous = lock.previous
    old_prefix, old_pid = previous.get("shm_prefix"), previous.get("pid")
    if isinstance(old_prefix, str) and old_prefix and isinstance(old_pid, int) and old_pid != os.getpid() \
            and not pid_alive(old_pid):
        removed = remove_stale_segments(old_prefix, shm_dir)
        if removed:
            log.warning("freed %d shared-memory segments left by worker %s's previous process (pid %d, %s-*)",
                        removed, worker_id, old_pid, old_prefix)
    return lock
