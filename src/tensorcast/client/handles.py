"""The asyncio artifact handles: ``AsyncArtifact`` and ``AsyncView``.

Owns: what a handle does with one artifact (read its tensors, views of it, prefetch/pin/unpin/evict, renew and
release its lease, refresh its record) through the parts of the client that made it (``HandleClient``), and
what a delete or a release does to the places this client kept (``deleted``). Does not own: the client
(``client.aio``), reading bytes (``client.reads``), the record's accessors shared with the sync handles
(``client.artifact``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, Unpack

import msgspec

from tensorcast.client.artifact import (
    ArtifactBase,
    Deletion,
    PrefetchOptions,
    build_view_slices,
    check_target,
    copy_into,
    like_of,
    prefetch_request,
)
from tensorcast.client.reads import Diagnostics, Reader
from tensorcast.client.workers import WorkerDirectory
from tensorcast.errors import InvalidArgument, NotFound, Unavailable, clip
from tensorcast.limits import check_ttl
from tensorcast.records import ArtifactInfo, SliceSpec
from tensorcast.views import TP, TPRules, sliced_shape, view_artifact_id
from tensorcast.wire.caller import Caller
from tensorcast.wire.messages import (
    DeleteArtifact,
    Evict,
    GetArtifact,
    Prefetched,
    ReleaseLease,
    RenewLease,
    Unpin,
)

__all__ = ["AsyncArtifact", "AsyncView", "HandleClient", "deleted"]


class HandleClient(Protocol):
    """What a handle uses of the ``AsyncClient`` that made it (named here, not imported: the client imports us)."""

    caller: Caller
    reader: Reader
    workers: WorkerDirectory


async def deleted(client: HandleClient, msg: DeleteArtifact | ReleaseLease) -> Deletion:
    """Send a delete or a lease release; when the content went, forget the places this client kept for it."""
    done = await client.caller.call(msg)
    if done.removed:
        client.reader.kept.forget(done.artifact_id)
    return Deletion(done.artifact_id, done.removed, done.keys)


class AsyncView:
    """A lazy slice of an artifact's tensors; materialized (sliced by the holder) only when asked."""

    def __init__(self, artifact: AsyncArtifact, slices: dict[str, tuple[SliceSpec, ...]],
                 view_id: str | None = None) -> None:
        self.artifact = artifact
        self.slices = slices
        self.view_id = view_id or view_artifact_id(artifact.id, slices)
        self.last_diagnostics: Diagnostics | None = None

    async def _materialize(self, names: tuple[str, ...], like: str, source: str, device: str = "cpu") -> dict[str, Any]:
        """Warm: a worker already materialized this view (``prefetch(tp=...)``): map that artifact.
        Cold: slice the parent where its replica lives."""
        client = self.artifact.client
        try:
            info = (await client.caller.call(GetArtifact(key_or_id=self.view_id))).artifact
            if any(r.alive for r in info.replicas):
                out, self.last_diagnostics = await client.reader.materialize(info, names, like, None, source, device)
                self.artifact._view_sources[self.view_id] = info, None
                return out
        except (NotFound, Unavailable):
            pass
        out = await self.artifact._materialize(names, like, source, self.slices, device)
        self.last_diagnostics = self.artifact.last_diagnostics
        self.artifact._view_sources[self.view_id] = self.artifact.info, self.slices
        return out

    def kept_tensors(self, names: tuple[str, ...], like: str = "torch", source: str = "auto",
                     device: str = "cpu") -> dict[str, Any] | None:
        """``names`` of this view mapped from places kept for what served the last read of it through this
        artifact handle (the view materialized on a worker, or the parent, cut here), with no round trip and no
        event loop; None before such a read, or when they are not all kept (then ``tensor_dict`` asks). A
        view materialized on a worker after a read cut the parent is not looked for while the parent's places
        stay kept (the bytes are the same). Any thread."""
        source_of = self.artifact._view_sources.get(self.view_id)
        if source_of is None or not all(n in self.slices for n in names):
            return None
        info, slices = source_of
        got = self.artifact.client.reader.materialize_kept(info, names, like, source, device, slices)
        if got is None:
            return None
        out, self.last_diagnostics = got
        return out

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(self.slices)

    def shape(self, name: str) -> tuple[int, ...]:
        return sliced_shape(self.artifact.meta(name).shape, self.slices[name])

    async def tensor(self, name: str | None = None, like: str = "torch", *, source: str = "auto",
                     device: str = "cpu") -> Any:
        if name is None:
            if len(self.slices) != 1:
                raise InvalidArgument(f"view holds {len(self.slices)} tensors: name one of {list(self.slices)}")
            name = next(iter(self.slices))
        if name not in self.slices:
            raise NotFound(f"view has no tensor {clip(name)}")
        return (await self._materialize((name,), like, source, device))[name]

    async def tensor_dict(self, like: str = "torch", *, source: str = "auto", device: str = "cpu") -> dict[str, Any]:
        """``{name: tensor}`` of this view; ``device="cuda[:N]"``: on that GPU (see ``AsyncArtifact.tensor``)."""
        return await self._materialize(self.tensor_names, like, source, device)

    async def tensor_dict_into(self, targets: Mapping[str, Any], *, source: str = "auto") -> None:
        for n in targets:
            if n not in self.slices:
                raise NotFound(f"view has no tensor {clip(n)}")
            meta = self.artifact.meta(n)
            check_target(msgspec.structs.replace(meta, shape=self.shape(n)), targets[n])
        copy_into(targets, await self._materialize(tuple(targets), like_of(targets), source))


class AsyncArtifact(ArtifactBase):
    """An immutable set of named tensors in the pool (asyncio flavour)."""

    def __init__(self, client: HandleClient, info: ArtifactInfo, own_key: str | None = None) -> None:
        super().__init__(info, own_key)
        self.client = client
        self.last_diagnostics: Diagnostics | None = None
        # A rank's view by its model type's rules: (slices, view id), built once (prefetch, then tensor_dict).
        self._rank_views: dict[TP, tuple[dict[str, tuple[SliceSpec, ...]], str]] = {}
        # What served each view's last read, by view id: the view's own artifact (no slices), or this one with
        # the view's slices. Written on the client's loop, read by ``AsyncView.kept_tensors`` on any thread.
        self._view_sources: dict[str, tuple[ArtifactInfo, dict[str, tuple[SliceSpec, ...]] | None]] = {}

    def kept_tensors(self, names: tuple[str, ...], like: str = "torch", source: str = "auto",
                     device: str = "cpu") -> dict[str, Any] | None:
        """``names`` mapped from places a same-host worker named before, with no round trip and no event loop
        (``client.read_maps``); None when they are not all kept (then ``tensor_dict`` asks). Any thread."""
        got = self.client.reader.materialize_kept(self.info, names, like, source, device)
        if got is None:
            return None
        out, self.last_diagnostics = got
        return out

    async def _materialize(self, names: tuple[str, ...], like: str, source: str,
                           slices: dict[str, tuple[SliceSpec, ...]] | None = None,
                           device: str = "cpu") -> dict[str, Any]:
        out, self.last_diagnostics = await self.client.reader.materialize(self.info, names, like, slices, source,
                                                                          device)
        return out

    async def tensor(self, name: str | None = None, like: str = "torch", *, source: str = "auto",
                     device: str = "cpu") -> Any:
        """One tensor. Same host: a copy-on-write mapping of the pool (no copy). Another host: fetched.
        ``device="cuda[:N]"`` (torch with CUDA): a same-host worker's copy on that device opened with CUDA IPC
        (no copy; see ``prefetch(device=...)``), else the host bytes copied there through pinned staging."""
        name = self._single_name(name)
        return (await self._materialize((name,), like, source, device=device))[name]

    async def tensor_dict(self, like: str = "torch", *, source: str = "auto", device: str = "cpu") -> dict[str, Any]:
        return await self._materialize(self.tensor_names, like, source, device=device)

    async def tensor_dict_into(self, targets: Mapping[str, Any], *, source: str = "auto") -> None:
        """Copy each named tensor into the caller's tensor of the same name (shape and dtype must match)."""
        for n in targets:
            check_target(self.meta(n), targets[n])
        copy_into(targets, await self._materialize(tuple(targets), like_of(targets), source))

    def view(self, slices: Mapping[str, Sequence[tuple[int, slice]]] | None = None, *, tp: TP | None = None,
             rules: TPRules | Mapping[str, Any] | None = None) -> AsyncView:
        """A lazy view: explicit ``slices={name: [(dim, slice), ...]}``, or one tensor-parallel rank's shard
        with ``tp=TP(rank, world_size)`` and ``rules`` (name pattern -> split dim or "replicated"; for a
        checkpoint, the rule set of its ``model_type`` by default)."""
        if tp is None or slices is not None or rules is not None:
            return AsyncView(self, build_view_slices(self.info, slices, tp, rules))
        if tp not in self._rank_views:
            view = AsyncView(self, build_view_slices(self.info, None, tp, None))
            self._rank_views[tp] = view.slices, view.view_id
        return AsyncView(self, *self._rank_views[tp])

    async def prefetch(self, to: str, **options: Unpack[PrefetchOptions]) -> Prefetched:
        """Copy this artifact into worker ``to``'s memory (worker-to-worker; a no-op where present). With
        ``tp=TP(rank, world)`` (or ``slices``), materialize only that view there: the warm path. With
        ``device="cuda:N"`` the worker also keeps a copy on that GPU, which same-host callers then open
        with CUDA IPC (``tensor_dict(device=...)``). Every option: ``PrefetchOptions``."""
        msg = prefetch_request(self.id, to, options)
        tp, slices, rules = options.get("tp"), options.get("slices"), options.get("rules")
        if tp is not None or slices is not None:
            view = self.view(slices, tp=tp, rules=rules)
            meta = {"tp": f"{tp.rank}/{tp.world_size}"} if tp is not None else {}
            msg = msgspec.structs.replace(msg, view=view.slices, view_id=view.view_id, view_meta=meta)
        elif rules is not None:
            raise InvalidArgument("rules= takes effect with tp=TP(rank, world_size)")
        ctx = self.client.caller.context(options.get("timeout"))
        done = await self.client.workers.send(to, msg, ctx)
        if msg.view is None and done.artifact is not None:
            self.info = done.artifact  # reads through this handle see the new replica
        return done

    async def evict(self, on: str) -> None:
        """Drop worker ``on``'s memory replica (a cache decision; its disk copy, if any, stays)."""
        await self.client.caller.call(Evict(artifact_id=self.id, worker_id=on))
        self.client.reader.kept.forget(self.id, on)

    async def pin(self, on: str, ttl: float | None = None) -> Prefetched:
        """Keep a memory replica resident on worker ``on`` (copied there first if needed) for ``ttl`` s."""
        return await self.prefetch(on, pin=True, pin_ttl=ttl)

    async def unpin(self, on: str) -> None:
        await self.client.caller.call(Unpin(artifact_id=self.id, worker_id=on))

    async def renew(self, ttl: float) -> AsyncArtifact:
        """Extend this handle's lease (its key's; without a key, that of puts without one) to ``ttl`` seconds
        from now. ``InvalidArgument`` if that reference is permanent (put without a ttl)."""
        check_ttl(ttl)
        msg = RenewLease(artifact_id=self.id, ttl=ttl, key=self.own_key)
        self.info = (await self.client.caller.call(msg)).artifact
        return self

    async def release(self) -> Deletion:
        """End this handle's lease now (the one ``renew`` extends); other keys are untouched, and the artifact
        goes only if nothing else keeps it (``Deletion.removed``)."""
        return await deleted(self.client, ReleaseLease(artifact_id=self.id, key=self.own_key))

    async def refresh(self) -> AsyncArtifact:
        self.info = (await self.client.caller.call(GetArtifact(key_or_id=self.id))).artifact
        return self
