"""The instance adaptor contract: how an execution engine plugs into TensorCast.

Owns: ``InstanceAdaptor`` (a ``Protocol``: four operations an engine implements) and ``InstanceLoad``
(the load signal it reports). An adaptor deals in ``{name: tensor}`` mappings only; the instance runtime
(``instance.runtime``) turns them into artifacts and back, so an adaptor needs no TensorCast calls.
Adaptor methods are called one at a time (the runtime serializes them), from a worker thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = ["InstanceAdaptor", "InstanceLoad"]


@dataclass(frozen=True)
class InstanceLoad:
    running: int = 0  # requests being decoded
    waiting: int = 0  # requests queued
    kv_tokens_used: int = 0
    kv_tokens_capacity: int = 0


@runtime_checkable
class InstanceAdaptor(Protocol):
    engine: str

    def publish(self, request_id: str, options: Mapping[str, Any]) -> Mapping[str, Any]:
        """Export ``request_id``'s KV cache as ``{name: tensor}``; the runtime stores it as one caller-leased
        artifact. Equal caches must give equal bytes (so a repeated publish is the same artifact)."""

    def hydrate(self, request_id: str, tensors: Mapping[str, Any], options: Mapping[str, Any]) -> None:
        """Load a published KV cache so that ``request_id`` continues exactly as if prefilled here."""

    def transform_into(self, tensors: Mapping[str, Any], options: Mapping[str, Any]) -> None:
        """Copy weight tensors into the engine's parameter buffers in place."""

    def load(self) -> InstanceLoad:
        """Current load, reported with every heartbeat."""

    def engine_command(self, command: str, args: Mapping[str, Any]) -> dict[str, Any]:
        """Engine-specific commands (e.g. start a request); ``InvalidArgument`` for unknown ones."""
