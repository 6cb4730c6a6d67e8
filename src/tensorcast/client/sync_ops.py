"""The synchronous client's batched and background facades: ``client.kv`` (``KV``) and ``client.ops``
(``Operations``).

Owns: blocking twins of ``AsyncKV``'s methods (lookups answered on the caller's thread where same-host presence
tables vouch for the keys), and each lifecycle call started on the client's loop as an ``Operation`` with the
parameters of its blocking twin. Does not own: the logic (``client.aio``, ``client.handles``, ``client.kv``) or
the loop (``client.sync``).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar, Unpack

from tensorcast.client.aio import AsyncClient
from tensorcast.client.artifact import Deletion, PrefetchOptions
from tensorcast.client.handles import AsyncArtifact
from tensorcast.client.kv import AsyncKV
from tensorcast.client.operation import Operation
from tensorcast.client.sync_handles import Artifact, Submitter
from tensorcast.client.weights_sync import Runner
from tensorcast.context import CallContext
from tensorcast.kv.blocks import BlockRegions
from tensorcast.kv.keys import KVLayout
from tensorcast.records import Placement
from tensorcast.views import TP, TPRules
from tensorcast.wire.messages import InstanceReply, Prefetched

__all__ = ["KV", "Operations"]

T = TypeVar("T")


class KV:
    """Synchronous facade of ``AsyncKV``."""

    def __init__(self, run: Runner, inner: AsyncKV) -> None:
        self._run = run
        self.inner = inner

    def put(self, keys: Sequence[str], pages: Sequence[Any], *, ttl: float | None = None,
            layout: KVLayout | None = None) -> int:
        """Store pages under their keys; see ``AsyncKV.put`` (what a page is, ``layout`` checks)."""
        return self._run(self.inner.put(keys, pages, ttl=ttl, layout=layout))

    def get(self, keys: Sequence[str]) -> list[Any]:
        return self._run(self.inner.get(keys))

    def get_into(self, keys: Sequence[str], buffers: Sequence[Any], *, layout: KVLayout | None = None,
                 exact: bool = False) -> list[bool]:
        """Receive pages straight into buffers; see ``AsyncKV.get_into`` (sizes, ``layout`` and ``exact``)."""
        return self._run(self.inner.get_into(keys, buffers, layout=layout, exact=exact))

    def exists(self, keys: Sequence[str]) -> int:
        """How many leading keys are present; see ``AsyncKV.exists``. Answered on this thread when same-host
        presence tables vouch for the keys up to the first miss (no hop to the client's event loop)."""
        n = self.inner.local_presence.exists(keys)
        return n if n is not None else self._run(self.inner.exists(keys))

    def present(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is present; see ``AsyncKV.present`` (answered on this thread like ``exists``)."""
        flags = self.inner.local_presence.present(keys)
        return flags if flags is not None else self._run(self.inner.present(keys))

    def put_blocks(self, keys: Sequence[str], blocks: Any, regions: BlockRegions, *, ttl: float | None = None) -> int:
        """Store blocks of a paged cache as pages; see ``AsyncKV.put_blocks``."""
        return self._run(self.inner.put_blocks(keys, blocks, regions, ttl=ttl))

    def get_blocks(self, keys: Sequence[str], blocks: Any, regions: BlockRegions) -> list[bool]:
        """Load pages into blocks of a paged cache; see ``AsyncKV.get_blocks``."""
        return self._run(self.inner.get_blocks(keys, blocks, regions))


class Operations:
    """``client.ops``: each lifecycle primitive started in the background, returning an ``Operation``. Each
    takes the parameters of its blocking twin (``Client.put``, ``Artifact.tensor_dict``, ``KV.put``, ...)."""

    def __init__(self, aio: AsyncClient, submit: Submitter, wrap: Callable[[AsyncArtifact], Artifact]) -> None:
        self._aio = aio
        self._submit = submit
        self._wrap = wrap

    def _op(self, name: str, coro: Coroutine[Any, Any, T]) -> Operation[T]:
        return Operation(self._submit(coro), name)

    def put(self, tensors: Any, key: str | None = None, *, ttl: float | None = None,
            policy: str | Placement | None = None, on: str | None = None, timeout: float | None = None,
            ctx: CallContext | None = None) -> Operation[Artifact]:
        """``Client.put`` in the background."""
        async def go() -> Artifact:
            return self._wrap(await self._aio.put(tensors, key, ttl=ttl, policy=policy, on=on, timeout=timeout,
                                                  ctx=ctx))

        return self._op("put", go())

    def get(self, key_or_id: str, like: str = "torch", *, source: str = "auto",
            device: str = "cpu") -> Operation[dict[str, Any]]:
        """The artifact's ``tensor_dict`` in the background."""
        async def go() -> dict[str, Any]:
            art = await self._aio.artifact(key_or_id)
            return await art.tensor_dict(like, source=source, device=device)

        return self._op("get", go())

    def view(self, key_or_id: str, *, slices: Mapping[str, Sequence[tuple[int, slice]]] | None = None,
             tp: TP | None = None, rules: TPRules | Mapping[str, Any] | None = None, like: str = "torch",
             source: str = "auto", device: str = "cpu") -> Operation[dict[str, Any]]:
        """``artifact.view(slices, tp=..., rules=...).tensor_dict(like, ...)`` in the background."""
        async def go() -> dict[str, Any]:
            art = await self._aio.artifact(key_or_id)
            return await art.view(slices, tp=tp, rules=rules).tensor_dict(like, source=source, device=device)

        return self._op("view", go())

    def prefetch(self, key_or_id: str, to: str, **options: Unpack[PrefetchOptions]) -> Operation[Prefetched]:
        return self._op("prefetch", self._aio.prefetch(key_or_id, to, **options))

    def pin(self, key_or_id: str, on: str, ttl: float | None = None) -> Operation[Prefetched]:
        return self._op("pin", self._aio.prefetch(key_or_id, on, pin=True, pin_ttl=ttl))

    def unpin(self, key_or_id: str, on: str) -> Operation[None]:
        async def go() -> None:
            await (await self._aio.lookup(key_or_id, to_read=False)).unpin(on)

        return self._op("unpin", go())

    def kv_put(self, keys: Sequence[str], pages: Sequence[Any], *, ttl: float | None = None,
               layout: KVLayout | None = None) -> Operation[int]:
        """``client.kv.put`` in the background (an engine saving pages without waiting for them); the pages'
        buffers must stay unchanged until the operation is done."""
        return self._op("kv_put", self._aio.kv.put(keys, pages, ttl=ttl, layout=layout))

    def delete(self, key_or_id: str) -> Operation[Deletion]:
        return self._op("delete", self._aio.delete(key_or_id))

    def release(self, key_or_id: str) -> Operation[Deletion]:
        async def go() -> Deletion:
            return await (await self._aio.lookup(key_or_id, to_read=False)).release()

        return self._op("release", go())

    def publish(self, instance: str, request_id: str) -> Operation[InstanceReply]:
        return self._op("publish", self._aio.call_instance(instance, "publish", request_id=request_id))

    def hydrate(self, instance: str, request_id: str, artifacts: Sequence[str]) -> Operation[InstanceReply]:
        return self._op("hydrate", self._aio.call_instance(instance, "hydrate", request_id=request_id,
                                                           artifacts=artifacts))

    def transform_into(self, instance: str, artifacts: Sequence[str]) -> Operation[InstanceReply]:
        return self._op("transform_into", self._aio.call_instance(instance, "transform_into",
                                                                  artifacts=artifacts))
