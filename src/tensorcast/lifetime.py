"""Dying with one's parent: the processes ``LocalCluster`` (and so ``tensorcast up``) starts end when it does.

Owns both sides of that agreement. The parent marks a child's environment (``child_env``) with its pid and
whether the child may ask the kernel for ``PR_SET_PDEATHSIG``. Linux sends that signal when the *thread*
that started the child ends, not the process, so it is allowed only for children started on the main thread
(whose end is the process's); the others rely on the watch alone. The child (``follow_parent``, at the start
of its main) takes the variables out of its environment (its own children do not inherit them), asks for
SIGTERM at its parent's death, checks ``getppid()`` right after (the parent may have died before the request
took effect), and watches ``getppid()`` on a daemon thread as the backstop: when the parent is gone it calls
``on_parent_gone`` once, which stops the process the way SIGTERM does (cleanly: segments unlinked, leases
released). Does not own: what stopping means for a process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

__all__ = ["PARENT_DEATHSIG_VAR", "PARENT_PID_VAR", "child_env", "follow_parent"]

PARENT_PID_VAR = "TENSORCAST_PARENT_PID"
PARENT_DEATHSIG_VAR = "TENSORCAST_PARENT_DEATHSIG"
_PR_SET_PDEATHSIG = 1
# How often a child looks whether its parent is still there (the backstop to PR_SET_PDEATHSIG).
WATCH_INTERVAL = 0.5
log = logging.getLogger("tensorcast.lifetime")


def child_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a child that must not outlive this process (started from the calling thread)."""
    out = dict(env)
    out[PARENT_PID_VAR] = str(os.getpid())
    out[PARENT_DEATHSIG_VAR] = "1" if threading.current_thread() is threading.main_thread() else "0"
    return out


def _set_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def follow_parent(on_parent_gone: Callable[[], None], interval: float = WATCH_INTERVAL) -> bool:
    """When this process was started by a parent that asked for it (``child_env``): arrange for
    ``on_parent_gone`` to be called once that parent is gone, and True. False (nothing arranged) otherwise.
    Set the process's SIGTERM handling first: the kernel's signal may come at once."""
    raw = os.environ.pop(PARENT_PID_VAR, "")
    deathsig = os.environ.pop(PARENT_DEATHSIG_VAR, "0") == "1"
    try:
        parent = int(raw)
    except ValueError:
        return False
    if deathsig:
        _set_pdeathsig(signal.SIGTERM)
    fired = threading.Event()

    def gone() -> None:
        if not fired.is_set():
            fired.set()
            log.warning("parent process %d is gone: stopping", parent)
            on_parent_gone()

    if os.getppid() != parent:  # it died before the request took effect (or before we looked)
        gone()
        return True

    def watch() -> None:
        while not fired.is_set():
            time.sleep(interval)
            if os.getppid() != parent:
                gone()

    threading.Thread(target=watch, name="tensorcast-parent-watch", daemon=True).start()
    return True
