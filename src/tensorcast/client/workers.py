"""Where a client's workers are: ``WorkerDirectory``.

Owns: the workers' addresses as the client last listed them (learned when it connects, listed again when it is
asked about a worker it does not know, forgotten when one cannot be reached), and sending a request about one
worker straight to that worker. Does not own: which gateway other calls go to (``wire.caller``), or the worker
listing as a signal (``AsyncClient.list_workers``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from tensorcast.context import CallContext
from tensorcast.errors import NotFound, Unavailable, clip
from tensorcast.records import WorkerInfo
from tensorcast.wire.caller import Caller
from tensorcast.wire.messages import ListWorkers, Request

__all__ = ["WorkerDirectory"]

R = TypeVar("R")


class WorkerDirectory:
    def __init__(self, caller: Caller) -> None:
        self.caller = caller
        self.known: dict[str, WorkerInfo] = {}

    def learn(self, workers: Iterable[WorkerInfo]) -> None:
        self.known = {w.worker_id: w for w in workers}

    async def address(self, worker_id: str) -> str:
        """Worker ``worker_id``'s address (listed again if it is not known); ``NotFound`` if there is none."""
        if worker_id not in self.known:
            self.learn((await self.caller.call(ListWorkers())).workers)
        try:
            return self.known[worker_id].address
        except KeyError:
            raise NotFound(f"no worker {clip(worker_id)}") from None

    async def send(self, worker_id: str, msg: Request[R], ctx: CallContext) -> R:
        """A request about worker ``worker_id``, sent to it directly when its address is known (one hop fewer
        than through the gateway, which routes it there too); else, or if it moved, through the gateway."""
        address = self.known[worker_id].address if worker_id in self.known else ""
        if address and address != self.caller.address:
            try:
                return await self.caller.call(msg, ctx, address=address)
            except Unavailable:
                self.known.pop(worker_id, None)
                await self.caller.drop(address)
        return await self.caller.call(msg, ctx)
