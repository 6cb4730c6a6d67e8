"""A verl checkpoint engine on TensorCast: weights from the actor to rollout replicas through the pool.

Selected by name in verl's configuration (the module registers ``tensorcast`` in verl's
``CheckpointEngineRegistry`` when imported, which ``custom_backend_module`` does on every worker)::

    actor_rollout_ref.rollout.checkpoint_engine.backend=tensorcast
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=tensorcast.integrations.verl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.tensorcast.address=GATEWAY:PORT

``engine_kwargs``: ``address`` (default ``TENSORCAST_ADDRESS``), ``model`` (the publisher's model name,
default ``verl-policy``), ``keep_last`` (versions kept, default 2), ``timeout`` (seconds a step may take,
default 300), ``verify`` (check what a rollout read against the published digests, default True); the
credential is each process's ``TENSORCAST_TOKEN``.

A ``CheckpointEngineWithCache``: the pool is the cache. ``send_weights`` (every actor rank iterates the
generator, whose gathers are collectives; rank 0 publishes version ``global_steps``, or the next one:
unchanged tensors are neither copied nor hashed again). ``receive_weights(global_steps)`` waits (within the
timeout, never forever) for that version, reads it from the pool (same host: mapped, no copy), checks it,
and yields ``(name, tensor)``. ``get_weights`` yields the newest version without waiting: rollouts sync
"without interrupting" ongoing requests, from the host's worker. No process group joins actor and rollout:
``build_topology`` only numbers the ranks. Does not own: publishing (``client.publisher``), the rollout
server's weight update (verl's server adapters).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterable
from typing import Any

from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.checkpoint_engine.base import CheckpointEngineWithCache

import tensorcast.aio as tca
from tensorcast.config import Config
from tensorcast.errors import DeadlineExceeded, InvalidArgument, NotFound
from tensorcast.integrations.rollout_checks import check_digests
from tensorcast.weights.versions import META_TENSORS, version_key

__all__ = ["TensorCastCheckpointEngine"]


@CheckpointEngineRegistry.register("tensorcast")
class TensorCastCheckpointEngine(CheckpointEngineWithCache):  # type: ignore[misc]
    def __init__(self, bucket_size: int = 0, *, address: str = "", model: str = "verl-policy", keep_last: int = 2,
                 timeout: float = 300.0, verify: bool = True) -> None:
        self.bucket_size = bucket_size  # verl's bucket size: nothing is bucketed here
        self.address = address or os.environ.get("TENSORCAST_ADDRESS", "")
        if not self.address:
            raise InvalidArgument("the tensorcast checkpoint engine needs engine_kwargs address= or "
                                  "TENSORCAST_ADDRESS")
        if not timeout > 0:
            raise InvalidArgument(f"timeout must be > 0, got {timeout!r}")
        self.model, self.keep_last, self.timeout, self.verify = model, keep_last, timeout, verify
        self.rank = 0
        self.role = "actor"
        self.last: dict[str, Any] = {}
        self._client: Any = None

    # ----------------------------------------------------------------- topology: none needed
    def prepare(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict[str, Any]]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        return ({"rank": list(range(actor_wg_world_size)), "role": ["actor"] * actor_wg_world_size},
                {"rank": list(range(rollout_world_size)), "role": ["rollout"] * rollout_world_size})

    def init_process_group(self, rank: int = 0, role: str = "actor", **kwargs: Any) -> None:
        self.rank, self.role = rank, role

    def finalize(self) -> None:
        return None  # the client is kept from step to step

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    # ----------------------------------------------------------------- actor
    async def send_weights(self, weights: Iterable[tuple[str, Any]] | AsyncIterator[tuple[str, Any]],
                           global_steps: int | None = None) -> None:
        state = {name: t.detach().cpu() if hasattr(t, "detach") else t async for name, t in _aiter(weights)}
        if self.rank != 0:
            return
        client = await self._connect()
        published = await client.publisher(self.model, keep_last=self.keep_last).publish(
            state, version=global_steps or None, timeout=self.timeout)  # version N is step N
        self.last = {"version": published.version, "bytes": published.nbytes,
                     "changed_bytes": published.changed_bytes, "seconds": published.seconds}

    # ----------------------------------------------------------------- rollout
    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, Any]]:
        client = await self._connect()
        than = None if global_steps is None else global_steps - 1
        newest = await client.publisher(self.model).wait_newer(than, timeout=self.timeout)
        if newest is None:
            raise DeadlineExceeded(f"no version {global_steps or ''} of {self.model} within {self.timeout:g} s")
        for item in (await self._read(client, newest if global_steps is None else global_steps)).items():
            yield item

    async def get_weights(self) -> AsyncIterator[tuple[str, Any]]:
        client = await self._connect()
        version = await client.publisher(self.model).latest()
        if version is None:
            raise NotFound(f"no version of {self.model} is published")
        for item in (await self._read(client, version)).items():
            yield item

    async def _read(self, client: Any, version: int) -> dict[str, Any]:
        art = await client.artifact(version_key(self.model, version), timeout=self.timeout)
        tensors = await art.tensor_dict(like="torch")
        for name in META_TENSORS:
            tensors.pop(name, None)  # the publisher's tag and delta record, not weights
        if self.verify:
            check_digests(art.info, tensors, f"{self.model} v{version}")
        self.last = {"version": version, "bytes": art.info.nbytes}
        return dict(tensors)

    async def _connect(self) -> Any:
        if self._client is None:
            config = Config.from_flat({"client.timeout": self.timeout})
            self._client = await tca.connect(self.address, config=config)
        return self._client


async def _aiter(items: Iterable[tuple[str, Any]] | AsyncIterator[tuple[str, Any]]) -> AsyncIterator[tuple[str, Any]]:
    if hasattr(items, "__aiter__"):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item
