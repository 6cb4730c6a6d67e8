"""The envelope every frame body is, the union of all messages, and what each request expects back.

Owns: ``Envelope`` (request id, kind, trace id, absolute deadline around one message), the frame kinds,
``Message`` (decoding an unknown tag fails cleanly) and ``REPLY_TO`` (the reply type of every request,
which ``wire.caller`` checks in one place). Does not own: the message types (``wire.messages``,
``wire.kv_messages``) or framing (``wire.frames``).
"""

from __future__ import annotations

import msgspec

from tensorcast.wire.kv_messages import (
    AcquireShards,
    GSStats,
    GSStatsReply,
    KVCommit,
    KVExists,
    KVExistsReply,
    KVGet,
    KVGetReply,
    KVPut,
    KVPutReply,
    KVRelease,
    ListShards,
    PageIndexGet,
    PageIndexPut,
    PageIndexReply,
    ReleaseShards,
    RenewShards,
    ShardGrants,
    ShardTable,
)
from tensorcast.wire.messages import (
    Ack,
    AddReplica,
    ArtifactList,
    ArtifactReply,
    CommitArtifact,
    DataHello,
    DataReply,
    DataRequest,
    DeleteArtifact,
    Deleted,
    DropArtifact,
    ErrorReply,
    Evict,
    GetArtifact,
    Heartbeat,
    HeartbeatReply,
    Hello,
    InstanceCall,
    InstanceHeartbeat,
    InstanceList,
    InstanceReply,
    ListArtifacts,
    ListInstances,
    ListWorkers,
    Mapped,
    MapTensors,
    PlanResult,
    Prefetch,
    Prefetched,
    PutAbort,
    PutBegin,
    PutCommit,
    PutData,
    PutDone,
    PutPlan,
    RegisterCheckpoint,
    Registered,
    RegisterInstance,
    RegisterWorker,
    ReleaseLease,
    RemoveReplica,
    RenewLease,
    ReportReads,
    RunPlan,
    Unpin,
    Welcome,
    WorkerList,
)

__all__ = ["ERROR", "IDEMPOTENT", "REPLY_TO", "REQUEST", "RESPONSE", "Envelope", "Message", "retry_safe"]

Message = (
    Hello
    | Welcome
    | Ack
    | ErrorReply
    | PutBegin
    | PutPlan
    | PutData
    | PutCommit
    | PutAbort
    | PutDone
    | ArtifactReply
    | DataHello
    | DataRequest
    | DataReply
    | MapTensors
    | ReportReads
    | Mapped
    | DropArtifact
    | Prefetch
    | Prefetched
    | Unpin
    | RegisterCheckpoint
    | Evict
    | GetArtifact
    | ListArtifacts
    | ArtifactList
    | DeleteArtifact
    | Deleted
    | RenewLease
    | ReleaseLease
    | ListWorkers
    | WorkerList
    | RegisterWorker
    | Registered
    | Heartbeat
    | HeartbeatReply
    | CommitArtifact
    | RemoveReplica
    | AddReplica
    | RegisterInstance
    | InstanceHeartbeat
    | ListInstances
    | InstanceList
    | InstanceCall
    | InstanceReply
    | RunPlan
    | PlanResult
    | ListShards
    | ShardTable
    | AcquireShards
    | RenewShards
    | ReleaseShards
    | ShardGrants
    | KVPut
    | KVPutReply
    | KVGet
    | KVGetReply
    | KVCommit
    | KVRelease
    | KVExists
    | KVExistsReply
    | GSStats
    | GSStatsReply
    | PageIndexPut
    | PageIndexGet
    | PageIndexReply
)

REQUEST, RESPONSE, ERROR = 0, 1, 2


class Envelope(msgspec.Struct, frozen=True, array_like=True):
    """Frame body: who/what/when around one message. ``deadline`` is absolute (``time.time()``);
    ``span_id`` is the sender's tracing span (0 when it traces nothing), the parent of the receiver's span."""

    request_id: int
    kind: int
    trace_id: str
    deadline: float | None
    body: msgspec.Raw
    span_id: int = 0


# The reply type of every request: a call checks the reply against it in one place (``wire.caller``).
REPLY_TO: dict[type, type] = {
    Hello: Welcome,
    PutBegin: PutPlan,
    PutData: Ack,
    PutCommit: PutDone,
    PutAbort: Ack,
    MapTensors: Mapped,
    ReportReads: Ack,
    Prefetch: Prefetched,
    RegisterCheckpoint: ArtifactReply,
    Unpin: Ack,
    Evict: Ack,
    DropArtifact: Ack,
    DataHello: DataReply,
    DataRequest: DataReply,
    GetArtifact: ArtifactReply,
    ListArtifacts: ArtifactList,
    DeleteArtifact: Deleted,
    RenewLease: ArtifactReply,
    ReleaseLease: Deleted,
    ListWorkers: WorkerList,
    RegisterInstance: Ack,
    InstanceHeartbeat: Ack,
    ListInstances: InstanceList,
    InstanceCall: InstanceReply,
    ListShards: ShardTable,
    AcquireShards: ShardGrants,
    RenewShards: ShardGrants,
    ReleaseShards: ShardGrants,
    KVPut: KVPutReply,
    KVCommit: KVPutReply,
    KVGet: KVGetReply,
    KVRelease: Ack,
    KVExists: KVExistsReply,
    GSStats: GSStatsReply,
    PageIndexPut: Ack,
    PageIndexGet: PageIndexReply,
    RunPlan: PlanResult,
    RegisterWorker: Registered,
    Heartbeat: HeartbeatReply,
    CommitArtifact: ArtifactReply,
    AddReplica: Ack,
    RemoveReplica: Ack,
}


# Requests whose effect is the same when they arrive twice: a caller may send one again (to another
# gateway) when the connection was lost before the reply came.
IDEMPOTENT: frozenset[type] = frozenset({
    GetArtifact, ListArtifacts, ListWorkers, ListInstances, ListShards, GSStats, PageIndexGet, Prefetch, Unpin,
    Evict, RenewLease, RegisterCheckpoint, RegisterInstance, InstanceHeartbeat, MapTensors, KVGet, KVExists,
    DataRequest,
    # Global-store writes whose repetition leaves the same state (a key pointed at the same artifact, a replica
    # or lease recorded again, a drop acknowledged twice): when a global store dies mid-request, the worker
    # sends them to another one. A second registration only bumps the incarnation the worker then uses.
    CommitArtifact, AddReplica, RemoveReplica, Heartbeat, RegisterWorker, AcquireShards, RenewShards,
    ReleaseShards, PageIndexPut,
})


def retry_safe(message: object) -> bool:
    """``message`` may be sent again after a lost reply. A plan is, when it carries an idempotency key (its
    steps are idempotent and finished ones are not redone)."""
    return type(message) in IDEMPOTENT or (isinstance(message, RunPlan) and bool(message.idempotency_key))
