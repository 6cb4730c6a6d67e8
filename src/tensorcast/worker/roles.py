"""What a worker role is, and the parts every role of one worker process shares.

Owns: the ``Role`` protocol (a service that registers its request handlers, starts its background work
and stops it) and ``WorkerParts`` (configuration, identity, the one caller, the global-store link, the
peer directory and the handler registry). Which roles a worker runs, and in what order they start, is
the process shell's table (``worker.server``). Adding a role: a class with these three methods and an
entry in that table.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from tensorcast.config import Config
from tensorcast.wire.caller import Caller
from tensorcast.wire.rpc import HandlerRegistry
from tensorcast.worker.gs_link import GlobalStoreLink
from tensorcast.worker.peers import Peers

__all__ = ["Activity", "Role", "WorkerParts"]


class Role(Protocol):
    def register(self, registry: HandlerRegistry) -> None:
        """Register this role's request handlers."""

    async def start(self) -> None:
        """Start background work (after the worker registered with the global store)."""

    async def stop(self) -> None:
        """Stop background work and release what the role holds."""


@dataclass
class Activity:
    """When this worker last received a request that moves or holds bytes (a put, a prefetch, a map, KV
    pages): background work (pre-faulting, trimming) waits for quiet. Signals and metadata do not count."""

    last: float = 0.0  # monotonic

    def touch(self) -> None:
        self.last = time.monotonic()

    def quiet_for(self) -> float:
        return time.monotonic() - self.last


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
