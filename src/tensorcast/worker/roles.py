"""What a worker role is, and the parts every role of one worker process shares.

Owns: the ``Role`` protocol (a service that registers its request handlers, starts its background work
and stops it), ``WorkerParts`` (configuration, identity, the one caller, the global-store link, the peer
directory and the handler registry) and ``StoragePort``, all that the other roles may ask of the storage
role (they reach nothing else of it). Which roles a worker runs, and in what order they start, is the
process shell's table (``worker.server.ROLES``). Adding a role: a class with these three methods and an
entry in that table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tensorcast import clock
from tensorcast.config import Config
from tensorcast.pool.device import DeviceTier
from tensorcast.records import ArtifactInfo, SliceSpec, TensorMeta
from tensorcast.wire.caller import Caller
from tensorcast.wire.messages import Prefetched
from tensorcast.wire.rpc import HandlerRegistry
from tensorcast.worker.gs_link import GlobalStoreLink
from tensorcast.worker.peers import Peers
from tensorcast.worker.store import LocalStore
from tensorcast.worker.trust import BlobTrust

__all__ = ["Activity", "Role", "StoragePort", "WorkerParts"]


class Role(Protocol):
    def register(self, registry: HandlerRegistry) -> None:
        """Register this role's request handlers."""

    async def start(self) -> None:
        """Start background work (after the worker registered with the global store)."""

    async def stop(self) -> None:
        """Stop background work and release what the role holds."""


class StoragePort(Protocol):
    """The storage role as the loading and gateway roles see it (``worker.storage.StorageRole``)."""

    store: LocalStore  # the pool: pins, tensors leased for a device copy, checkpoints registered in place
    trust: BlobTrust  # bytes are handed out only once checked
    devices: DeviceTier  # copies on CUDA devices, for same-host IPC hand-offs

    @property
    def data_address(self) -> str:
        """Where this worker's data server listens ("" before it starts)."""

    async def fetch(self, info: ArtifactInfo, deadline: float | None, trace_id: str, streams: int = 0) -> Prefetched:
        """Hold a memory replica of ``info`` here, pulled from the best source."""

    async def materialize_view(self, info: ArtifactInfo, view: dict[str, tuple[SliceSpec, ...]], view_id: str,
                               deadline: float | None, trace_id: str) -> tuple[Prefetched, tuple[TensorMeta, ...]]:
        """Build artifact ``view_id`` in memory from slices of ``info``'s tensors."""

    def fetched(self, kind: str, result: Prefetched) -> None:
        """Account for a prefetch or a view materialized here."""

    def drop(self, artifact_id: str) -> None:
        """Forget every local copy of a deleted artifact."""


@dataclass
class Activity:
    """When this worker last received a request that moves or holds bytes (a put, a prefetch, a map, KV
    pages): background work (pre-faulting, trimming) waits for quiet. Signals and metadata do not count."""

    last: float = 0.0  # monotonic

    def touch(self) -> None:
        self.last = clock.monotonic()

    def quiet_for(self) -> float:
        return clock.monotonic() - self.last


@dataclass
class WorkerParts:
    config: Config
    worker_id: str
    host_id: str
    roles: tuple[str, ...]
    caller: Caller  # default address: the global store
    gs: GlobalStoreLink
    peers: Peers
    registry: HandlerRegistry
    activity: Activity
    address: str = ""  # this worker's RPC address, once it serves
