"""The envelope every frame body is, the union of all messages, and what each request expects back.

Owns: ``Envelope`` (request id, kind, trace id, absolute deadline around one message), the frame kinds,
``Message`` (decoding an unknown tag fails cleanly), ``REPLY_TO`` (the reply type of every request, which
``wire.caller`` checks in one place) and ``REQUIRED_ROLE`` (the weakest credential that may send each request,
which every server checks in one place). Does not own: the message types (the modules ``wire.messages``
lists), framing (``wire.frames``) or the roles themselves (``credentials``).
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from tensorcast.credentials import CLIENT, READ_ONLY, WORKER
from tensorcast.wire.kv_messages import (
    AcquireShards,
    GSStats,
    KVCommit,
    KVExists,
    KVGet,
    KVHandoff,
    KVPut,
    KVRelease,
    KVReplicate,
    KVShardsReleased,
    ListShards,
    PageIndexGet,
    PageIndexPut,
    ReleaseShards,
    RenewShards,
)
from tensorcast.wire.messages import (
    MESSAGE_MODULES,
    AddReplica,
    CommitArtifact,
    CommitArtifacts,
    DataHello,
    DataRequest,
    DeleteArtifact,
    DropArtifact,
    Evict,
    GetArtifact,
    Heartbeat,
    Hello,
    InstanceCall,
    InstanceHeartbeat,
    ListArtifacts,
    ListInstances,
    ListUnderReplicated,
    ListWorkers,
    MapTensors,
    Msg,
    Prefetch,
    Proof,
    PutAbort,
    PutBegin,
    PutCommit,
    PutData,
    RegisterCheckpoint,
    RegisterInstance,
    RegisterWorker,
    ReleaseLease,
    RemoveReplica,
    RenewLease,
    ReportReads,
    Request,
    RevokeReads,
    RunPlan,
    Unpin,
)

__all__ = ["ERROR", "HANDSHAKE", "IDEMPOTENT", "MESSAGE_TYPES", "REPLY_TO", "REQUEST", "REQUESTS", "REQUIRED_ROLE",
           "RESPONSE", "Envelope", "Message", "required_role", "retry_safe"]


def _message_types() -> tuple[type, ...]:
    """Every message type: the ``Msg`` subclasses the catalogue's message modules define."""
    return tuple(obj for mod in MESSAGE_MODULES for obj in vars(mod).values()
                 if isinstance(obj, type) and issubclass(obj, Msg) and obj not in (Msg, Request)
                 and obj.__module__ == mod.__name__)


MESSAGE_TYPES: tuple[type, ...] = _message_types()
# The union a frame body decodes into (by tag: an unknown one fails cleanly).
Message: Any = Union[MESSAGE_TYPES]  # noqa: UP007 (a union built at run time)
REQUESTS: tuple[type[Request[Any]], ...] = tuple(t for t in MESSAGE_TYPES if issubclass(t, Request))

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


# The reply type of every request, as declared (``class GetArtifact(Request[ArtifactReply])``): a call checks
# the reply against it in one place (``wire.caller``). Hello's reply may be a Challenge, answered by a Proof.
REPLY_TO: dict[type, type] = {t: t.reply_type() for t in REQUESTS}


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
    RegisterWorker: WORKER, Heartbeat: WORKER, CommitArtifact: WORKER, CommitArtifacts: WORKER, AddReplica: WORKER,
    RemoveReplica: WORKER, RevokeReads: WORKER,
    DropArtifact: WORKER, AcquireShards: WORKER, RenewShards: WORKER, ReleaseShards: WORKER, KVHandoff: WORKER,
    KVReplicate: WORKER, KVShardsReleased: WORKER, RegisterInstance: WORKER, InstanceHeartbeat: WORKER,
}


def required_role(message: object) -> str:
    """The weakest role that may send ``message`` (``worker`` for anything not in ``REQUIRED_ROLE``)."""
    return REQUIRED_ROLE.get(type(message), WORKER)


# Requests whose effect is the same when they arrive twice (declared ``idempotent = True``): a caller may send
# one again (to another gateway) when the connection was lost before the reply came.
IDEMPOTENT: frozenset[type] = frozenset(t for t in REQUESTS if t.idempotent)


def retry_safe(message: object) -> bool:
    """``message`` may be sent again after a lost reply. A plan is, when it carries an idempotency key (its
    steps are idempotent and finished ones are not redone)."""
    return type(message) in IDEMPOTENT or (isinstance(message, RunPlan) and bool(message.idempotency_key))
