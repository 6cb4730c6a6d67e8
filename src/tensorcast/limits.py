"""The documented bounds of durations callers give: leases (``ttl``), timeouts and deadlines.

Owns: checking that a caller's number of seconds is a real, finite number within bounds, with one clear
``InvalidArgument`` naming the parameter otherwise (a NaN lease would be stored as no expiry, an infinite
one would never expire, ``1e-9`` would expire before the put returns, ``"5"`` would fail deep inside).
Used on both sides of the wire: the client fails fast, the servers never trust the client. Pure.
"""

from __future__ import annotations

import math
from typing import Any

from tensorcast.errors import InvalidArgument, clip

__all__ = ["MAX_TIMEOUT", "MAX_TTL", "MIN_TTL", "check_deadline", "check_timeout", "check_ttl"]

MIN_TTL = 1.0  # seconds: a lease shorter than a round trip would expire before it is acknowledged
MAX_TTL = 10 * 365 * 86400.0  # ten years: for longer, leave the artifact system-owned (ttl=None)
MAX_TIMEOUT = 365 * 86400.0


def _seconds(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{what} must be a number of seconds, got {clip(value)}")
    if not math.isfinite(value):
        raise InvalidArgument(f"{what} must be finite, got {value}")
    return float(value)


def check_ttl(value: Any, what: str = "ttl") -> float:
    """A lease length: a finite number of seconds in [MIN_TTL, MAX_TTL]."""
    seconds = _seconds(value, what)
    if not MIN_TTL <= seconds <= MAX_TTL:
        raise InvalidArgument(f"{what} must be between {MIN_TTL:g} and {MAX_TTL:g} seconds, got {value}")
    return seconds


def check_timeout(value: Any, what: str = "timeout") -> float | None:
    """A timeout: None (no limit) or a finite number of seconds in [0, MAX_TIMEOUT] (0: the deadline is now,
    so nothing starts)."""
    if value is None:
        return None
    seconds = _seconds(value, what)
    if not 0 <= seconds <= MAX_TIMEOUT:
        raise InvalidArgument(f"{what} must be between 0 and {MAX_TIMEOUT:g} seconds, got {value}")
    return seconds


def check_deadline(value: Any) -> float | None:
    """An absolute deadline (Unix time) received from a peer: None or a finite number."""
    if value is None:
        return None
    return _seconds(value, "deadline")
