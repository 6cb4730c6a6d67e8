"""The control plane's clocks, behind one seam: wall time (``time()``, the global store's lease and deadline
clock) and CLOCK_MONOTONIC (``monotonic()``, a shard home's local lease expiry and page TTLs).

Owns: the two functions every lease, deadline and timeout of the control plane reads, and ``installed``, which
swaps both for a simulated cluster's virtual clock (``tensorcast.testing.sim``) so that failovers, TTLs and
timeouts run in virtual time, exactly and reproducibly. Outside a simulation they are the real clocks. Does
not own: the event loop's own clock (a simulation runs on a loop whose ``time()`` is the same virtual clock),
or clocks shared between processes through memory (``kv.presence`` compares CLOCK_MONOTONIC across
processes of a host, and keeps the real one).
"""

from __future__ import annotations

import contextlib
import time as _time
from collections.abc import Callable, Iterator

__all__ = ["installed", "monotonic", "time"]

_wall: Callable[[], float] = _time.time
_mono: Callable[[], float] = _time.monotonic


def time() -> float:
    """Wall-clock seconds since the epoch (``time.time()``, unless a simulation installed its own)."""
    return _wall()


def monotonic() -> float:
    """CLOCK_MONOTONIC seconds (``time.monotonic()``, unless a simulation installed its own)."""
    return _mono()


@contextlib.contextmanager
def installed(wall: Callable[[], float], mono: Callable[[], float]) -> Iterator[None]:
    """Read ``wall`` and ``mono`` instead of the real clocks while the block runs (one simulation at a time)."""
    global _wall, _mono
    before = _wall, _mono
    _wall, _mono = wall, mono
    try:
        yield
    finally:
        _wall, _mono = before
