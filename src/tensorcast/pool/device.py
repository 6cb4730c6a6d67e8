"""A worker's device tier: copies of memory replicas on its CUDA devices, for the warm GPU hand-off.

Owns: which artifacts this worker holds on which device (tensors allocated by torch in this process),
their bytes under ``worker.device_capacity``, and dropping them with their memory replica. A copy is made
from the memory replica with the pipelined host-to-device path (``transport.h2d``) and handed to same-host
callers as CUDA IPC handles (``transport.cuda_ipc``): they alias this process's memory, so the engine
attaches without a copy. The device tier is only a cache of the memory tier: the global store does not
know it, and losing it loses nothing. Does not own: the memory tier, or anything on hosts without CUDA
(``InvalidArgument`` from ``cuda.check_device``).
"""

from __future__ import annotations

import threading
from typing import Any

from tensorcast.errors import NotFound, ResourceExhausted

__all__ = ["DeviceTier"]


class DeviceTier:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # bytes over all devices; 0 = only the devices' own memory limits it
        self.used = 0
        self._lock = threading.Lock()
        # (artifact, device) -> ({name: tensor}, bytes reserved for them)
        self._copies: dict[tuple[str, str], tuple[dict[str, Any], int]] = {}

    def has(self, artifact_id: str, device: str) -> bool:
        return (artifact_id, device) in self._copies

    def get(self, artifact_id: str, device: str) -> dict[str, Any]:
        try:
            return self._copies[(artifact_id, device)][0]
        except KeyError:
            raise NotFound(f"artifact {artifact_id} has no copy on {device} here") from None

    def reserve(self, nbytes: int) -> None:
        with self._lock:
            if self.capacity and self.used + nbytes > self.capacity:
                raise ResourceExhausted(f"device tier full: {self.used} + {nbytes} bytes > worker.device_capacity "
                                        f"{self.capacity}")
            self.used += nbytes

    def add(self, artifact_id: str, device: str, tensors: dict[str, Any], nbytes: int) -> None:
        """Keep ``tensors`` (``nbytes`` reserved before the copy) as the device copy of ``artifact_id``."""
        with self._lock:
            if (artifact_id, device) in self._copies:
                self.used -= nbytes  # someone was faster: keep theirs
                return
            self._copies[(artifact_id, device)] = (tensors, nbytes)

    def unreserve(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes

    def remove(self, artifact_id: str) -> None:
        """Drop every device copy of an artifact (its memory replica went). Consumers that opened them keep
        the memory alive through torch's IPC reference counts until they let go."""
        with self._lock:
            for key in [k for k in self._copies if k[0] == artifact_id]:
                self.used -= self._copies.pop(key)[1]
