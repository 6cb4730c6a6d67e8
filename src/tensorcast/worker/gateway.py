"""The gateway role: the callers' entry point — metadata relayed to the global store, deletes, plans.

Owns: relaying metadata requests (``GetArtifact``, ``ListArtifacts``, ``ListWorkers``, ``RenewLease``,
``ListShards``, ``GSStats``, the page-index benchmark calls) with the caller's trace id and deadline (a
same-host caller's ``GetArtifact`` with ``map`` also gets the places of this worker's memory copy, so that its
first read makes no call of its own; for an id whose checked memory copy it holds, it asks for a read lease and
answers such look-ups itself while the lease lasts: ``gs.read_leases``, ``worker.held_reads``);
``DeleteArtifact``/``ReleaseLease`` (recorded at the store; when that removed the artifact — no reference
keeps it — this worker's copy is freed at once, and the other holders drop theirs at their next heartbeat);
and running plans (``RunPlan``) as the ``GatewayPort`` the plan operations use. Does not own: plan scheduling
(``plans``), the instances' calls (``worker.instances``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from tensorcast import clock
from tensorcast.context import CallContext
from tensorcast.errors import NotFound, TensorCastError, clip
from tensorcast.plans.executor import PlanExecutor
from tensorcast.records import ArtifactInfo, SegmentRef
from tensorcast.tensors import ARTIFACT_ID_RE
from tensorcast.wire.kv_messages import GSStats, ListShards, PageIndexGet, PageIndexPut
from tensorcast.wire.messages import (
    ArtifactReply,
    DeleteArtifact,
    Deleted,
    GetArtifact,
    InstanceCall,
    InstanceReply,
    ListArtifacts,
    ListWorkers,
    PlanResult,
    ReleaseLease,
    RenewLease,
    RevokeReads,
    RunPlan,
)
from tensorcast.wire.rpc import HandlerRegistry, Request
from tensorcast.wire.session_messages import Ack
from tensorcast.worker.held_reads import HeldReads
from tensorcast.worker.roles import StoragePort, WorkerParts

__all__ = ["GatewayRole"]

RELAYED: tuple[type, ...] = (ListArtifacts, ListWorkers, RenewLease, ListShards, GSStats, PageIndexPut, PageIndexGet)


class GatewayRole:
    def __init__(self, parts: WorkerParts, storage: StoragePort) -> None:
        self.parts = parts
        self.storage = storage
        self.plans = PlanExecutor(self, max_attempts=parts.config.worker.plan_max_attempts)
        self.held = HeldReads(longest=parts.config.gs.read_lease_seconds)

    def register(self, registry: HandlerRegistry) -> None:
        for msg_type in RELAYED:
            registry.register(msg_type, self.parts.gs.relay)
        registry.register(GetArtifact, self.get_artifact)
        registry.register(DeleteArtifact, self.delete)
        registry.register(ReleaseLease, self.delete)
        registry.register(RunPlan, self.run_plan)
        registry.register(RevokeReads, self.revoke_reads)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def get_artifact(self, msg: GetArtifact, req: Request) -> ArtifactReply:
        mapping = msg.map and req.peer is not None and req.peer.host_id == self.parts.host_id
        by_id = mapping and ARTIFACT_ID_RE.match(msg.key_or_id) is not None
        if by_id and (held := self.held.answer(msg.key_or_id)) is not None and (places := self._places(held)):
            return ArtifactReply(artifact=held, segments=places, mapped_by=self.parts.worker_id)
        # A lease only where this worker's own copy could answer (``_places`` then says whether it does).
        lease = by_id and self.storage.store.memory.has_replica(msg.key_or_id)
        asked_at = clock.monotonic()
        reply: ArtifactReply = await self.parts.gs.forward(
            msgspec.structs.replace(msg, read_lease=lease), req.ctx)
        if reply.read_lease_seconds > 0:
            self.held.keep(reply.artifact, reply.read_lease_seconds, asked_at)
            reply = msgspec.structs.replace(reply, read_lease_seconds=0.0)
        if mapping:
            places = self._places(reply.artifact)
            if places:
                reply = msgspec.structs.replace(reply, segments=places, mapped_by=self.parts.worker_id)
        return reply

    async def revoke_reads(self, msg: RevokeReads, req: Request) -> Ack:
        if msg.worker_id != self.parts.worker_id:  # meant for a worker that was at this address before
            raise NotFound(f"this is worker {self.parts.worker_id}, not {clip(msg.worker_id)}")
        self.held.revoke(msg.artifact_ids)
        return Ack()

    def _places(self, info: ArtifactInfo) -> tuple[SegmentRef | None, ...]:
        """Where this worker's memory copy of ``info`` keeps each tensor, if it holds one whose bytes need no
        check before they are handed out (else (): the caller's read asks, and the check runs then)."""
        store = self.storage.store
        names = tuple(t.name for t in info.tensors)
        try:
            if not names or not store.memory.has_replica(info.id) or self.storage.trust.unchecked_read(info.id, names):
                return ()
            return tuple(store.segment_refs(info.id, names, "memory"))
        except TensorCastError:  # a tensor without a memory copy here (dropped meanwhile): the read asks
            return ()

    async def delete(self, msg: DeleteArtifact | ReleaseLease, req: Request) -> Deleted:
        reply = await self.parts.gs.call(msg, req.ctx)
        if reply.removed:  # free our copy now; other holders at their next heartbeat
            self.storage.drop(reply.artifact_id)
        return reply

    async def run_plan(self, msg: RunPlan, req: Request) -> PlanResult:
        return await self.plans.run(msg, req.ctx)

    # ----------------------------------------------------------------- GatewayPort (plan operations)
    async def route(self, worker_id: str, msg: Any, ctx: CallContext) -> Any:
        return await self.parts.peers.route(worker_id, msg, ctx)

    async def gs_call(self, msg: Any, ctx: CallContext) -> Any:
        if isinstance(msg, DeleteArtifact | ReleaseLease):
            return await self.delete(msg, Request(conn=None, ctx=ctx, payload=None, peer=None))
        return await self.parts.gs.forward(msg, ctx)

    async def instance_call(self, instance_id: str, msg: InstanceCall, ctx: CallContext) -> InstanceReply:
        return await self.parts.peers.call_instance(msg, ctx)

    async def worker_ids(self, ctx: CallContext) -> set[str]:
        return await self.parts.peers.worker_ids(ctx)

    async def instance_ids(self, ctx: CallContext) -> set[str]:
        return await self.parts.peers.instance_ids(ctx)
