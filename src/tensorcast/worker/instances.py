"""The instance registry (part of the basic role): engines attach to a worker, their home.

Owns: relaying an instance's registration and load heartbeats to the global store (an instance talks only
to its home worker), the instance list (the load signal callers' policies read), and running one instance
operation (``InstanceCall``: publish, hydrate, transform_into, an engine command) on the instance it
names. Does not own: the instance runtime (``instance.runtime``) or plans that chain such calls.
"""

from __future__ import annotations

from tensorcast.wire.messages import InstanceCall, InstanceHeartbeat, InstanceReply, ListInstances, RegisterInstance
from tensorcast.wire.rpc import HandlerRegistry, Request
from tensorcast.worker.roles import WorkerParts

__all__ = ["InstanceRegistry"]


class InstanceRegistry:
    def __init__(self, parts: WorkerParts) -> None:
        self.parts = parts

    def register(self, registry: HandlerRegistry) -> None:
        for msg_type in (RegisterInstance, InstanceHeartbeat, ListInstances):
            registry.register(msg_type, self.parts.gs.relay)
        registry.register(InstanceCall, self.call_instance)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def call_instance(self, msg: InstanceCall, req: Request) -> InstanceReply:
        return await self.parts.peers.call_instance(msg, req.ctx)
