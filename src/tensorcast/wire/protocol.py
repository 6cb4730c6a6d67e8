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
    RunPlan,
    Unpin,
    Welcome,
    WorkerList,
)

__all__ = ["ERROR", "REPLY_TO", "REQUEST", "RESPONSE", "Envelope", "Message"]

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
    """Frame body: who/what/when around one message. ``deadline`` is absolute (``time.time()``)."""

    request_id: int
    kind: int
    trace_id: str
    deadline: float | None
    body: msgspec.Raw


# The reply type of every request: a call checks the reply against it in one place (``wire.caller``).
REPLY_TO: dict[type, type] = {
    Hello: Welcome,
    PutBegin: PutPlan,
    PutData: Ack,
    PutCommit: PutDone,
    PutAbort: Ack,
    MapTensors: Mapped,
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
