"""The envelope every frame body is, the union of all messages, and what each request expects back.

Owns: ``Envelope`` (request id, kind, trace id, absolute deadline around one message), the frame kinds,
``Message`` (decoding an unknown tag fails cleanly), ``REPLY_TO`` (the reply type of every request, which
``wire.caller`` checks in one place) and ``REQUIRED_ROLE`` (the weakest credential that may send each request,
which every server checks in one place). Does not own: the message types (``wire.messages``,
``wire.kv_messages``), framing (``wire.frames``) or the roles themselves (``credentials``).
"""

from __future__ import annotations

import msgspec

from tensorcast.credentials import CLIENT, READ_ONLY, WORKER
from tensorcast.wire.kv_messages import (
    AcquireShards,
    GSStats,
    GSStatsReply,
    KVCommit,
    KVExists,
    KVExistsReply,
    KVGet,
    KVGetReply,
    KVHandoff,
    KVPages,
    KVPut,
    KVPutReply,
    KVRelease,
    KVReplicate,
    KVShardsReleased,
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
    Challenge,
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
    ListUnderReplicated,
    ListWorkers,
    Mapped,
    MapTensors,
    PlanResult,
    Prefetch,
    Prefetched,
    Proof,
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
    UnderReplicated,
    Unpin,
    Welcome,
    WorkerList,
)

__all__ = ["ERROR", "HANDSHAKE", "IDEMPOTENT", "REPLY_TO", "REQUEST", "REQUIRED_ROLE", "RESPONSE", "Envelope",
           "Message", "required_role", "retry_safe"]

Message = (
    Hello
    | Challenge
    | Proof
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
    | KVHandoff
    | KVPages
    | KVReplicate
    | KVShardsReleased
    | KVExistsReply
    | GSStats
    | GSStatsReply
    | PageIndexPut
    | PageIndexGet
    | PageIndexReply
    | ListUnderReplicated
    | UnderReplicated
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
    Hello: Welcome,  # or a Challenge, answered by a Proof (``wire.handshake``)
    Proof: Welcome,
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
    KVHandoff: KVPages,
    KVReplicate: KVPutReply,
    KVShardsReleased: Ack,
    GSStats: GSStatsReply,
    PageIndexPut: Ack,
    PageIndexGet: PageIndexReply,
    RunPlan: PlanResult,
    RegisterWorker: Registered,
    Heartbeat: HeartbeatReply,
    CommitArtifact: ArtifactReply,
    AddReplica: Ack,
    RemoveReplica: Ack,
    ListUnderReplicated: UnderReplicated,
}


# What opens a connection (before any role is known).
HANDSHAKE: frozenset[type] = frozenset({Hello, Proof, DataHello})

# The weakest role whose credential may send each request (``credentials``: read-only < client < worker).
# Every server checks it before the handler runs (``PermissionDenied``); a request type missing here needs
# ``worker``. Reads are read-only; what changes artifacts, keys, leases, pins, KV pages or plans is the
# client's; what only the cluster's own processes send (registration, heartbeats, replica and commit
# bookkeeping, shard leases, messages between workers, instances attaching) is the worker's.
REQUIRED_ROLE: dict[type, str] = {
    # reads
    GetArtifact: READ_ONLY, ListArtifacts: READ_ONLY, ListWorkers: READ_ONLY, ListInstances: READ_ONLY,
    ListShards: READ_ONLY, GSStats: READ_ONLY, PageIndexGet: READ_ONLY, ListUnderReplicated: READ_ONLY,
    MapTensors: READ_ONLY, ReportReads: READ_ONLY, DataRequest: READ_ONLY, KVGet: READ_ONLY,
    KVExists: READ_ONLY, KVRelease: READ_ONLY,
    # writes and deletes of a caller
    PutBegin: CLIENT, PutData: CLIENT, PutCommit: CLIENT, PutAbort: CLIENT, Prefetch: CLIENT,
    RegisterCheckpoint: CLIENT, Unpin: CLIENT, Evict: CLIENT, DeleteArtifact: CLIENT, RenewLease: CLIENT,
    ReleaseLease: CLIENT, RunPlan: CLIENT, InstanceCall: CLIENT, KVPut: CLIENT, KVCommit: CLIENT,
    PageIndexPut: CLIENT,
    # the cluster's own bookkeeping
    RegisterWorker: WORKER, Heartbeat: WORKER, CommitArtifact: WORKER, AddReplica: WORKER, RemoveReplica: WORKER,
    DropArtifact: WORKER, AcquireShards: WORKER, RenewShards: WORKER, ReleaseShards: WORKER, KVHandoff: WORKER,
    KVReplicate: WORKER, KVShardsReleased: WORKER, RegisterInstance: WORKER, InstanceHeartbeat: WORKER,
}


def required_role(message: object) -> str:
    """The weakest role that may send ``message`` (``worker`` for anything not in ``REQUIRED_ROLE``)."""
    return REQUIRED_ROLE.get(type(message), WORKER)


# Requests whose effect is the same when they arrive twice: a caller may send one again (to another
# gateway) when the connection was lost before the reply came.
IDEMPOTENT: frozenset[type] = frozenset({
    GetArtifact, ListArtifacts, ListWorkers, ListInstances, ListShards, GSStats, PageIndexGet, Prefetch, Unpin,
    Evict, RenewLease, RegisterCheckpoint, RegisterInstance, InstanceHeartbeat, MapTensors, KVGet, KVExists,
    DataRequest, ListUnderReplicated,
    # Between shard homes: a hand-over batch is asked for again from the same cursor, a copy to a backup stored
    # again is kept once, a release is read again.
    KVHandoff, KVReplicate, KVShardsReleased,
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
