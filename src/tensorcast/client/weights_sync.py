"""Synchronous facades of weight sync: ``WeightPublisher`` and ``Binding``.

Owns: blocking twins of ``AsyncWeightPublisher`` and ``AsyncBinding`` (each public async method has a twin
with the same parameters), run on the synchronous client's event-loop thread. A ``Binding`` may be used
from any thread, e.g. an engine's worker thread (the vLLM worker process case). Does not own: the logic,
which lives once in ``client.publisher`` and ``client.binding``.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Coroutine, Mapping
from typing import Any, Protocol, TypeVar

from tensorcast.client.binding import AsyncBinding, SwapReport
from tensorcast.client.publisher import AsyncWeightPublisher, Published

__all__ = ["Binding", "Runner", "WeightPublisher"]

T = TypeVar("T")


class Runner(Protocol):
    def __call__(self, coro: Coroutine[Any, Any, T]) -> T: ...


class WeightPublisher:
    """Publishes versions of one model; see ``AsyncWeightPublisher``."""

    def __init__(self, run: Runner, inner: AsyncWeightPublisher) -> None:
        self._run = run
        self.inner = inner

    @property
    def model(self) -> str:
        return self.inner.model

    @property
    def keep_last(self) -> int:
        return self.inner.keep_last

    @property
    def last(self) -> Published | None:
        return self.inner.last

    def publish(self, state_dict: Mapping[str, Any], version: int | None = None, *,
                changed: Collection[str] | None = None, timeout: float | None = None) -> Published:
        """Put a version (unchanged tensors cost no copy), then collect old unused versions; ``changed``: the
        names of the tensors changed since this publisher's previous publish, if known (see
        ``AsyncWeightPublisher.publish``)."""
        return self._run(self.inner.publish(state_dict, version, changed=changed, timeout=timeout))

    def gc(self, *, timeout: float | None = None) -> tuple[int, ...]:
        return self._run(self.inner.gc(timeout=timeout))

    def versions(self) -> list[int]:
        return self._run(self.inner.versions())

    def latest(self) -> int | None:
        return self._run(self.inner.latest())

    def in_use(self) -> dict[int, tuple[str, ...]]:
        return self._run(self.inner.in_use())

    def wait_newer(self, than: int | None = None, timeout: float | None = None) -> int | None:
        """The newest version above ``than`` once one exists; None after ``timeout`` s (bounded polling)."""
        return self._run(self.inner.wait_newer(than, timeout))


class Binding:
    """Bound tensors that versions are swapped into in place; see ``AsyncBinding``."""

    def __init__(self, run: Runner, inner: AsyncBinding) -> None:
        self._run = run
        self.inner = inner

    @property
    def model(self) -> str:
        return self.inner.model

    @property
    def holder(self) -> str:
        return self.inner.holder

    @property
    def tensors(self) -> dict[str, Any]:
        return self.inner.tensors

    @property
    def active_version(self) -> int | None:
        return self.inner.active_version

    @property
    def lock(self) -> threading.RLock:
        """Held while an activation writes the bound tensors; hold it around a forward pass to keep swaps out."""
        return self.inner.lock

    @property
    def last_report(self) -> SwapReport | None:
        return self.inner.last_report

    def status(self) -> dict[str, Any]:
        return self.inner.status()

    def swap(self, version: int | None = None, *, expected: int | None = None,
             timeout: float | None = None, fetch: str = "view") -> SwapReport:
        return self._run(self.inner.swap(version, expected=expected, timeout=timeout, fetch=fetch))

    def prepare(self, version: int | None = None, *, expected: int | None = None, swap_id: str | None = None,
                timeout: float | None = None, fetch: str = "view") -> SwapReport:
        return self._run(self.inner.prepare(version, expected=expected, swap_id=swap_id, timeout=timeout,
                                            fetch=fetch))

    def activate(self, swap_id: str | None = None, *, expected: int | None = None) -> SwapReport:
        return self._run(self.inner.activate(swap_id, expected=expected))

    def abort(self, swap_id: str | None = None) -> None:
        self._run(self.inner.abort(swap_id))

    def wait_newer(self, timeout: float | None = None) -> int | None:
        return self._run(self.inner.wait_newer(timeout))

    def close(self) -> None:
        self._run(self.inner.close())
