"""``Operation``: a lazy handle on one lifecycle call running in the background.

Owns: the caller-facing handle (``result(timeout)``, ``done()``, ``status()``, ``exception()``, ``cancel()``)
over a future of the client's event loop. The request is sent when the operation is created; the caller
blocks only in ``result``. Does not own: what the call does.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Generic, Literal, TypeVar

from tensorcast.errors import DeadlineExceeded, TensorCastError

__all__ = ["Operation", "OperationStatus"]

T = TypeVar("T")
OperationStatus = Literal["pending", "running", "succeeded", "failed", "cancelled"]


class Operation(Generic[T]):
    def __init__(self, future: concurrent.futures.Future[T], name: str) -> None:
        self._future = future
        self.name = name

    def result(self, timeout: float | None = None) -> T:
        """Block until done; raise the operation's error, or ``DeadlineExceeded`` after ``timeout`` s
        (the operation keeps running)."""
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise DeadlineExceeded(f"{self.name}: not done after {timeout}s (still running)") from None

    def done(self) -> bool:
        return self._future.done()

    def status(self) -> OperationStatus:
        f = self._future
        if f.cancelled():
            return "cancelled"
        if not f.done():
            return "running" if f.running() else "pending"
        return "failed" if f.exception() is not None else "succeeded"

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            return self._future.exception(timeout)
        except concurrent.futures.CancelledError as exc:
            return exc

    def cancel(self) -> bool:
        """Stop waiting for the operation; work a worker already started may still complete."""
        return self._future.cancel()

    @property
    def retryable(self) -> bool:
        exc = self._future.exception() if self._future.done() and not self._future.cancelled() else None
        return isinstance(exc, TensorCastError) and exc.retryable

    def __repr__(self) -> str:
        return f"<Operation {self.name} {self.status()}>"

    def __await__(self) -> Any:
        import asyncio

        return asyncio.wrap_future(self._future).__await__()
