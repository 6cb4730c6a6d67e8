"""The synchronous artifact handles: ``Artifact`` and ``View``.

Owns: blocking twins of ``AsyncArtifact`` and ``AsyncView`` (each public async method has a twin with the same
parameters), run on the synchronous client's event-loop thread, and reads of kept same-host places on the
caller's own thread before any hop to that loop. Does not own: the logic, which lives once in
``client.handles``, or the loop (``client.sync``).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, Protocol, TypeVar, Unpack

from tensorcast.client.artifact import ArtifactBase, Deletion, PrefetchOptions
from tensorcast.client.handles import AsyncArtifact, AsyncView
from tensorcast.client.operation import Operation
from tensorcast.client.reads import Diagnostics
from tensorcast.client.weights_sync import Runner
from tensorcast.views import TP, TPRules
from tensorcast.wire.messages import Prefetched

__all__ = ["Artifact", "Submitter", "View"]

T = TypeVar("T")


class Submitter(Protocol):
    """Starts a coroutine on the client's loop and returns its future at once (for an ``Operation``)."""

    def __call__(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]: ...


class View:
    """A lazy slice of an artifact (``Artifact.view``); the holder cuts it, so only its bytes move."""

    def __init__(self, artifact: Artifact, inner: AsyncView) -> None:
        self._artifact = artifact
        self._inner = inner

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return self._inner.tensor_names

    @property
    def view_id(self) -> str:
        """The artifact id this view has once materialized on a worker (``prefetch(tp=...)``)."""
        return self._inner.view_id

    @property
    def last_diagnostics(self) -> Diagnostics | None:
        return self._inner.last_diagnostics

    def shape(self, name: str) -> tuple[int, ...]:
        return self._inner.shape(name)

    def tensor(self, name: str | None = None, like: str = "torch", *, source: str = "auto",
               device: str = "cpu") -> Any:
        names = self._inner.tensor_names
        single = name if name is not None else names[0] if len(names) == 1 else None
        if single is not None:  # read before: no hop to the client's loop
            kept = self._inner.kept_tensors((single,), like, source, device)
            if kept is not None:
                return kept[single]
        return self._artifact._sync(self._inner.tensor(name, like, source=source, device=device))

    def tensor_dict(self, like: str = "torch", *, source: str = "auto", device: str = "cpu") -> dict[str, Any]:
        """``{name: tensor}`` of this view (e.g. one rank's weights); ``device="cuda[:N]"``: on that GPU. Places
        kept from an earlier read of this view are mapped on the caller's thread (``AsyncView.kept_tensors``)."""
        kept = self._inner.kept_tensors(self.tensor_names, like, source, device)
        if kept is not None:
            return kept
        return self._artifact._sync(self._inner.tensor_dict(like, source=source, device=device))

    def tensor_dict_into(self, targets: Mapping[str, Any], *, source: str = "auto") -> None:
        self._artifact._sync(self._inner.tensor_dict_into(targets, source=source))


class Artifact(ArtifactBase):
    """An immutable set of named tensors in the pool. Materialized only on ``tensor``/``tensor_dict``."""

    def __init__(self, run: Runner, submit: Submitter, inner: AsyncArtifact) -> None:
        super().__init__(inner.info, inner.own_key)
        self._run = run
        self._submit = submit
        self._inner = inner

    def _sync(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine of the inner handle on the client's loop; this handle then shows its record."""
        try:
            return self._run(coro)
        finally:
            self.info = self._inner.info

    @property
    def last_diagnostics(self) -> Diagnostics | None:
        """How the last materialization was served: replica, tier, transport, bytes moved, time, retries."""
        return self._inner.last_diagnostics

    def tensor(self, name: str | None = None, like: str = "torch", *, source: str = "auto",
               device: str = "cpu") -> Any:
        """One tensor. Same host: a copy-on-write mapping of the pool's memory (no copy; writes stay
        private). Another host: fetched over the data plane. ``source``: auto, local_only, prefer_p2p,
        prefer_disk. ``device="cuda[:N]"`` (torch with CUDA): a same-host worker's copy on that GPU opened
        with CUDA IPC (no copy; ``prefetch(device=...)``), else the bytes copied there through pinned
        staging buffers, pipelined."""
        single = self._single_name(name)
        kept = self._inner.kept_tensors((single,), like, source, device)  # read before: no hop to the client's loop
        if kept is not None:
            return kept[single]
        return self._sync(self._inner.tensor(name, like, source=source, device=device))

    def tensor_dict(self, like: str = "torch", *, source: str = "auto", device: str = "cpu") -> dict[str, Any]:
        kept = self._inner.kept_tensors(self.tensor_names, like, source, device)
        if kept is not None:
            return kept
        return self._sync(self._inner.tensor_dict(like, source=source, device=device))

    def tensor_dict_into(self, targets: Mapping[str, Any], *, source: str = "auto") -> None:
        """Fill caller-owned tensors in place (e.g. ``model.state_dict()``)."""
        self._sync(self._inner.tensor_dict_into(targets, source=source))

    def view(self, slices: Mapping[str, Sequence[tuple[int, slice]]] | None = None, *, tp: TP | None = None,
             rules: TPRules | Mapping[str, Any] | None = None) -> View:
        """A lazy view: ``slices={name: [(dim, slice), ...]}`` or ``tp=TP(rank, world_size)`` with ``rules``."""
        return View(self, self._inner.view(slices, tp=tp, rules=rules))

    def prefetch(self, to: str, **options: Unpack[PrefetchOptions]) -> Operation[Prefetched]:
        """Copy the artifact into worker ``to``'s memory, worker-to-worker; with ``tp=TP(rank, world)`` only
        that rank's view (the warm path for weights); with ``device="cuda:N"`` also onto that GPU of the
        worker, for CUDA IPC hand-offs. Returns at once. Every option: ``PrefetchOptions``."""
        return Operation(self._submit(self._inner.prefetch(to, **options)), "prefetch")

    def evict(self, on: str) -> None:
        """Drop worker ``on``'s memory replica now (its disk copy, if any, stays)."""
        self._sync(self._inner.evict(on))

    def pin(self, on: str, ttl: float | None = None) -> Prefetched:
        """Keep a memory replica resident on worker ``on`` (copied there first if needed)."""
        return self._sync(self._inner.pin(on, ttl))

    def unpin(self, on: str) -> None:
        self._sync(self._inner.unpin(on))

    def renew(self, ttl: float) -> Artifact:
        """Extend this handle's lease (its key's, or for a handle without a key the lease of puts without
        one) to ``ttl`` seconds from now; see ``AsyncArtifact.renew``."""
        self._sync(self._inner.renew(ttl))
        return self

    def release(self) -> Deletion:
        """End this handle's lease now; the artifact goes only if nothing else keeps it (``removed``)."""
        return self._sync(self._inner.release())

    def refresh(self) -> Artifact:
        self._sync(self._inner.refresh())
        return self
