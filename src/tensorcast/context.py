"""CallContext: the trace id, absolute deadline and idempotency key that travel with an operation.

Owns: creating contexts (``tensorcast.context(...)``), the task-local "current" context used for logging,
and deadline arithmetic. The deadline is absolute wall-clock time (``clock.time()``), computed once from the
timeout, so every process an operation touches sees the same instant. Does not own: retries or plans.
"""

from __future__ import annotations

import contextvars
import random
from dataclasses import dataclass, field, replace

from tensorcast import clock
from tensorcast.errors import DeadlineExceeded
from tensorcast.limits import check_deadline, check_timeout

__all__ = ["CallContext", "context", "current_trace_id", "new_trace_id"]

_current_trace: contextvars.ContextVar[str] = contextvars.ContextVar("tensorcast_trace", default="")


def new_trace_id() -> str:
    """64 random bits in hex. From ``random``, not the OS: a trace id only has to be unique, and every call
    makes one (``uuid4`` reads ``os.urandom``, a system call, and was a sixth of a call's time on the
    caller's side). ``random`` reseeds in a forked child, so processes never share a sequence."""
    return f"{random.getrandbits(64):016x}"


def current_trace_id() -> str:
    return _current_trace.get()


def set_current_trace(trace_id: str) -> contextvars.Token[str]:
    return _current_trace.set(trace_id)


@dataclass(frozen=True, slots=True)
class CallContext:
    trace_id: str = field(default_factory=new_trace_id)
    deadline: float | None = None
    idempotency_key: str | None = None
    tags: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        check_deadline(self.deadline)  # a NaN or infinite deadline is refused, never silently "no deadline"

    def remaining(self) -> float | None:
        """Seconds left before the deadline (may be negative), or None without a deadline."""
        return None if self.deadline is None else self.deadline - clock.time()

    def check(self, what: str = "call") -> None:
        """Raise ``DeadlineExceeded`` if the deadline has passed: never start work that cannot finish."""
        left = self.remaining()
        if left is not None and left <= 0:
            raise DeadlineExceeded(
                f"{what}: deadline passed {-left:.3f}s ago", trace_id=self.trace_id
            )

    def with_timeout(self, timeout: float | None) -> CallContext:
        """A context whose deadline is the earlier of this one's and ``now + timeout``."""
        seconds = check_timeout(timeout)
        if seconds is None:
            return self
        deadline = clock.time() + seconds
        if self.deadline is not None:
            deadline = min(deadline, self.deadline)
        return replace(self, deadline=deadline)


def context(
    timeout: float | None = None,
    idempotency_key: str | None = None,
    trace_id: str | None = None,
    tags: dict[str, str] | None = None,
) -> CallContext:
    """Make a CallContext; ``timeout`` seconds from now becomes the absolute deadline."""
    check_timeout(timeout)
    return CallContext(
        trace_id=trace_id or new_trace_id(),
        deadline=None if timeout is None else clock.time() + timeout,
        idempotency_key=idempotency_key,
        tags=tuple(sorted((tags or {}).items())),
    )
