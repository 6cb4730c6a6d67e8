"""A worker's calls to other workers and to engine instances, by id.

Owns: resolving a worker id or an instance id to its address (worker addresses cached from the global
store's list and refreshed on a miss; instances looked up per call, since their liveness matters), and
sending a typed request there through the worker's caller. Requests aimed at this worker itself are
dispatched to its own handlers in process, so a plan or a routed call treats every worker alike. Does
not own: what the requests mean.
"""

from __future__ import annotations

from typing import Any, TypeVar, cast

from tensorcast.context import CallContext
from tensorcast.errors import InternalError, NotFound, Unavailable, clip
from tensorcast.wire.caller import Caller
from tensorcast.wire.messages import InstanceCall, InstanceReply, Request
from tensorcast.wire.rpc import HandlerRegistry
from tensorcast.worker.gs_link import GlobalStoreLink

__all__ = ["Peers"]

R = TypeVar("R")


class Peers:
    def __init__(self, worker_id: str, caller: Caller, gs: GlobalStoreLink, local: HandlerRegistry) -> None:
        self.worker_id = worker_id
        self.caller = caller
        self.gs = gs
        self.local = local
        self._addresses: dict[str, str] = {}

    async def worker_ids(self, ctx: CallContext) -> set[str]:
        return {w.worker_id for w in await self.gs.list_workers(ctx)}

    async def instance_ids(self, ctx: CallContext) -> set[str]:
        return {i.instance_id for i in await self.gs.list_instances(ctx)}

    async def address(self, worker_id: str, ctx: CallContext) -> str:
        address = self._addresses.get(worker_id)
        if address is None:
            self._addresses = {w.worker_id: w.address for w in await self.gs.list_workers(ctx)}
            address = self._addresses.get(worker_id)
            if address is None:
                raise NotFound(f"no worker {clip(worker_id)}")
        return address

    async def call(self, worker_id: str, msg: Request[R], ctx: CallContext) -> R:
        """Run ``msg`` on worker ``worker_id`` (this one included) and return its reply."""
        if worker_id == self.worker_id:
            reply = await self.local.dispatch(msg, ctx)
            expect = type(msg).reply_type()
            if not isinstance(reply, expect):
                raise InternalError(f"{type(msg).__name__} answered with {type(reply).__name__} here, expected "
                                    f"{expect.__name__}")
            return cast(R, reply)
        return await self.caller.call(msg, ctx, address=await self.address(worker_id, ctx))

    async def route(self, worker_id: str, msg: Any, ctx: CallContext) -> Any:
        """``call`` with the reply type the request implies (plans route any worker operation)."""
        return await self.call(worker_id, msg, ctx)

    async def call_instance(self, msg: InstanceCall, ctx: CallContext) -> InstanceReply:
        """Run one instance operation on the instance's runtime (``Unavailable`` if it stopped heartbeating)."""
        info = next((i for i in await self.gs.list_instances(ctx) if i.instance_id == msg.instance_id), None)
        if info is None:
            raise NotFound(f"no instance {clip(msg.instance_id)}")
        if not info.alive:
            raise Unavailable(f"instance {clip(msg.instance_id)} is not alive (no heartbeat)")
        return await self.caller.call(msg, ctx, address=info.address)
