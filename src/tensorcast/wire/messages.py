"""The catalogue of the messages TensorCast processes exchange: every module that defines some, and each of their
names in one place.

Owns: ``MESSAGE_MODULES`` (the modules whose ``Msg`` subclasses are the wire's messages: ``wire.protocol``
derives the union of all messages, the reply table and the idempotent set from them), and the one import path
for the messages but the KV-page ones: connection set-up, generic replies and the data plane
(``wire.session_messages``), artifact metadata (``wire.metadata_messages``), puts, maps and prefetches
(``wire.artifact_messages``), the cluster's bookkeeping (``wire.cluster_messages``), plans and instances
(``wire.plan_messages``). Does not own: the messages themselves (those modules, and ``wire.kv_messages``), their
bases (``wire.message_base``), the envelope and the derived tables (``wire.protocol``), framing and connections
(``wire.frames``, ``wire.rpc``), or what a handler does.

Adding a message: define it in the module of its concern (a new module of messages goes into
``MESSAGE_MODULES``, and its names here): a request as a ``Request[ItsReply]`` (with ``idempotent = True``
where a repeat is harmless), anything else as a ``Msg``; then give a request its role in
``wire.protocol.REQUIRED_ROLE`` and register a handler.
"""

from __future__ import annotations

from types import ModuleType

from tensorcast.wire import (
    artifact_messages,
    cluster_messages,
    kv_messages,
    metadata_messages,
    plan_messages,
    session_messages,
)
from tensorcast.wire.artifact_messages import (
    MAX_REPORTED_READS,
    DropArtifact,
    Evict,
    Mapped,
    MapTensors,
    Prefetch,
    Prefetched,
    PutAbort,
    PutBegin,
    PutCommit,
    PutData,
    PutDone,
    PutPlan,
    ReadCount,
    RegisterCheckpoint,
    ReportReads,
    Unpin,
)
from tensorcast.wire.cluster_messages import (
    AddReplica,
    CommitArtifact,
    CommitArtifacts,
    CommitOutcome,
    CommitsDone,
    Heartbeat,
    HeartbeatReply,
    ListUnderReplicated,
    ListWorkers,
    Registered,
    RegisterWorker,
    RemoveReplica,
    UnderReplicated,
    WorkerList,
)
from tensorcast.wire.message_base import Msg, Request
from tensorcast.wire.metadata_messages import (
    ArtifactList,
    ArtifactReply,
    DeleteArtifact,
    Deleted,
    GetArtifact,
    ListArtifacts,
    ReleaseLease,
    RenewLease,
    RevokeReads,
)
from tensorcast.wire.plan_messages import (
    InstanceCall,
    InstanceHeartbeat,
    InstanceList,
    InstanceReply,
    ListInstances,
    PlanResult,
    RegisterInstance,
    RunPlan,
)
from tensorcast.wire.session_messages import (
    PROTOCOL_VERSION,
    Ack,
    Challenge,
    DataHello,
    DataReply,
    DataRequest,
    ErrorReply,
    Hello,
    Proof,
    Welcome,
)

__all__ = ["Ack", "AddReplica", "ArtifactList", "ArtifactReply", "Challenge", "CommitArtifact", "CommitArtifacts",
           "CommitOutcome", "CommitsDone", "DataHello", "DataReply", "DataRequest", "DeleteArtifact", "Deleted",
           "DropArtifact", "ErrorReply", "Evict",
           "GetArtifact", "Heartbeat", "HeartbeatReply", "Hello", "InstanceCall", "InstanceHeartbeat", "InstanceList",
           "InstanceReply", "ListArtifacts", "ListInstances", "ListUnderReplicated", "ListWorkers",
           "MAX_REPORTED_READS", "MESSAGE_MODULES", "MapTensors", "Mapped", "Msg", "PROTOCOL_VERSION", "PlanResult",
           "Prefetch", "Prefetched", "Proof", "PutAbort", "PutBegin", "PutCommit", "PutData", "PutDone", "PutPlan",
           "ReadCount", "RegisterCheckpoint", "RegisterInstance", "RegisterWorker", "Registered", "ReleaseLease",
           "RemoveReplica", "RenewLease", "ReportReads", "RevokeReads", "Request", "RunPlan", "UnderReplicated",
           "Unpin", "Welcome", "WorkerList"]

# Every module whose Msg subclasses travel on the wire (a message defined anywhere else is not decodable).
MESSAGE_MODULES: tuple[ModuleType, ...] = (session_messages, metadata_messages, artifact_messages,
                                           cluster_messages, plan_messages, kv_messages)
