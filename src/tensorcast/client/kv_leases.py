"""The caller's side of the read leases of same-host KV gets.

Owns: the read leases this client holds (a same-host ``KVGet`` reply names the slots of its hits, which the
shard home keeps from reuse until the lease is handed back): handing each back with the next get to the same
home (``take``), or, when none follows, after ``_RELEASE_DELAY`` at the latest in one ``KVRelease`` for all
of that home's, so a get loop pays no extra round trip for releases; and handing back every one still held
at close. Does not own: the gets and the copies out of the slots (``client.kv``, ``client.kv_local``), or
what a home does with a lease (``kv.home``).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from tensorcast.errors import TensorCastError
from tensorcast.wire.caller import Caller
from tensorcast.wire.kv_messages import KVRelease

__all__ = ["ReadLeases"]

# Read leases are handed back with the next get to the same home, or after this many seconds.
_RELEASE_DELAY = 0.05


class ReadLeases:
    def __init__(self, caller: Caller) -> None:
        self.caller = caller
        self._tasks: set[asyncio.Task[Any]] = set()
        self._done: dict[str, list[str]] = {}  # home address -> read leases to hand back

    def done(self, address: str, lease: str) -> None:
        """The copies out of ``lease``'s slots are made: hand it back with the next get to that home, or after
        ``_RELEASE_DELAY`` at the latest."""
        pending = self._done.setdefault(address, [])
        pending.append(lease)
        if len(pending) == 1:
            task = asyncio.ensure_future(self._flush(address))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def take(self, address: str) -> tuple[str, ...]:
        """The leases to hand back to ``address`` with the request about to go there."""
        return tuple(self._done.pop(address, ()))

    async def _flush(self, address: str) -> None:
        await asyncio.sleep(_RELEASE_DELAY)
        leases = self.take(address)
        if leases:
            with contextlib.suppress(TensorCastError):
                await self.caller.call(KVRelease(leases=leases), address=address)

    async def aclose(self) -> None:
        """Hand back every read lease still held."""
        for task in list(self._tasks):
            task.cancel()
        for address in list(self._done):
            leases = self.take(address)
            if leases:
                with contextlib.suppress(TensorCastError, OSError):
                    await self.caller.call(KVRelease(leases=leases), address=address)
