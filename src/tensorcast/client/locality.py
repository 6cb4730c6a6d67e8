"""Whether a peer's bytes can be handed over through this host's shared memory.

Owns: this process's host id and the one switch that turns the shared-memory paths off for the rest of
the process when a peer reports the same host id but its files cannot be opened here (another container
without a shared ``/dev/shm``): puts, reads and KV pages then take the socket path. Shared by the client,
its reader and its KV client. Does not own: mapping anything.
"""

from __future__ import annotations

__all__ = ["Locality"]


class Locality:
    def __init__(self, host_id: str, shared_memory: bool = True) -> None:
        self.host_id = host_id
        self._shared_memory = shared_memory

    @property
    def shared_memory(self) -> bool:
        return self._shared_memory

    def same_host(self, host_id: str) -> bool:
        """True when a peer on ``host_id`` can hand bytes over through shared memory."""
        return self._shared_memory and host_id == self.host_id

    def shared_memory_unreachable(self) -> None:
        """A same-host peer's files were not visible here: use the socket paths from now on."""
        self._shared_memory = False
