"""An asyncio event loop on a virtual clock: timers fire in order, instantly in real time.

Owns: ``VirtualClock`` (wall and monotonic seconds that only move when the loop has nothing ready to run),
and ``VirtualLoop``, whose selector, asked to wait, moves the clock to the next timer instead of sleeping (the
control plane reads the same virtual clock through ``tensorcast.clock``, which the run installs). Work handed to
threads (``run_in_executor``, ``asyncio.to_thread``) runs at once on the loop's own thread, in order: it takes
no virtual time, and a seed replays exactly (threads finishing in real time would reorder what follows). A
loop with nothing ready and no timer can never continue, and says so (``SimulationStalled``) instead of
hanging. Does not own: what runs on it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import selectors
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["SimulationStalled", "VirtualClock", "VirtualLoop"]

T = TypeVar("T")


class SimulationStalled(RuntimeError):
    """Every task waits for something that cannot happen: nothing ready, no timer, no thread at work."""


class VirtualClock:
    """Seconds since the simulation began, as wall-clock time (``time()``) and CLOCK_MONOTONIC."""

    def __init__(self, wall_start: float = 1.9e9, monotonic_start: float = 10_000.0) -> None:
        self.elapsed = 0.0
        self._wall = wall_start
        self._mono = monotonic_start

    def time(self) -> float:
        return self._wall + self.elapsed

    def monotonic(self) -> float:
        return self._mono + self.elapsed

    def advance(self, seconds: float) -> None:
        if seconds > 0:
            self.elapsed += seconds


class _Selector(selectors.DefaultSelector):
    """Polls real file descriptors without waiting (the loop's self-pipe); a wait is a jump of the virtual
    clock."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self.clock = clock

    def select(self, timeout: float | None = None) -> list[Any]:
        events = super().select(0)
        if events or timeout == 0:
            return list(events)
        if timeout is None:
            raise SimulationStalled("no task can run and no timer is set")
        self.clock.advance(timeout)
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        super().__init__(_Selector(clock))

    def time(self) -> float:
        return self.clock.monotonic()

    def run_in_executor(self, executor: concurrent.futures.Executor | None, func: Callable[..., T],  # type: ignore[override]
                        *args: Any) -> asyncio.Future[T]:
        """``func(*args)`` now, on this thread: its result (or error) is ready at once."""
        fut: asyncio.Future[T] = self.create_future()
        try:
            fut.set_result(func(*args))
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            fut.set_exception(exc)
        return fut
