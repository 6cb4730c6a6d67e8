"""The messages TensorCast processes exchange, as frozen, tagged msgspec Structs built from ``records``.

Owns: the ``Msg`` base, the protocol version and every message but the KV-page ones (``wire.kv_messages``):
connection set-up, generic replies, puts, maps, prefetch, the data plane's control frames, metadata,
instances, plans and the worker's calls to the global store. Does not own: the envelope, the union of
all messages or the reply table (``wire.protocol``), framing and connections (``wire.frames``,
``wire.rpc``), or what a handler does.

Adding a message: define it here (or in ``wire.kv_messages``): a request as a ``Request[ItsReply]`` (with
``idempotent = True`` where a repeat is harmless), anything else as a ``Msg``; then give a request its role in
``wire.protocol.REQUIRED_ROLE`` and register a handler. The union of all messages, the reply table and the
idempotent set are derived from these declarations.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from tensorcast.records import (
    ArtifactInfo,
    CudaIpcHandle,
    InstanceInfo,
    Placement,
    ReplicaInfo,
    SegmentRef,
    SliceSpec,
    StepResult,
    StepSpec,
    TensorMeta,
    WorkerInfo,
    WorkerLoad,
)
from tensorcast.wire.message_base import Msg as Msg
from tensorcast.wire.message_base import Request as Request

# 2: records moved out of messages; ArtifactInfo travels inside ArtifactReply; payload checksums.
# 3: small puts in one request (PutBegin.inline with the bytes as its payload; PutPlan.artifact).
# 5: keys are independent references. 6: challenge-response handshake (Challenge, Proof); credentials carry roles.
# 7: Heartbeat carries the worker's load as one record (WorkerLoad).
PROTOCOL_VERSION = 7




# --------------------------------------------------------------------------- connection set-up


class Hello(Request["Welcome"]):
    """Opens a connection. ``role``: the credential's role ("" without one), ``nonce`` the caller's fresh
    random bytes; the credential itself never travels (``wire.handshake``)."""

    protocol_version: int
    role: str = ""
    nonce: bytes = b""
    peer_id: str = ""
    host_id: str = ""


class Challenge(Msg):
    """Server -> caller, to a ``Hello`` with a role: the server's fresh ``nonce``, and its ``proof`` that it
    holds the role's key (an HMAC over both nonces and the context)."""

    nonce: bytes
    server_id: str = ""
    proof: bytes = b""


class Proof(Request["Welcome"]):
    """Caller -> server, answering a ``Challenge``: the HMAC of the role's key over this connection's nonces and
    context. The reply is ``Welcome`` (``DataReply`` on the data plane) or an error."""

    proof: bytes


class Welcome(Msg):
    protocol_version: int
    server_id: str
    host_id: str
    roles: tuple[str, ...] = ()


# --------------------------------------------------------------------------- generic replies


class Ack(Msg):
    pass


class ErrorReply(Msg):
    code: str
    message: str
    retryable: bool = False


# --------------------------------------------------------------------------- caller <-> worker


class PutBegin(Request["PutPlan"]):
    """Start storing an artifact. The worker answers with a ``PutPlan``."""

    tensors: tuple[TensorMeta, ...]
    key: str | None = None
    ttl: float | None = None
    # The caller can map this worker's shared memory (same host id and reachable /dev/shm).
    same_host: bool = False
    # A preset name ("cache", "durable", "ha", "cold", "warm", "pinned") or a general Placement.
    placement: str | Placement | None = None
    # A small put in one request: every tensor's bytes follow as this request's payload, one after another
    # in this order; digests may be left empty (the worker computes them from the bytes). The worker stores
    # and commits at once; PutPlan.artifact is the committed record.
    inline: bool = False
    # Same host only: digests may be left empty and come with PutCommit instead, so that the caller hashes
    # those bytes while it writes them. The worker cannot skip them up front: each gets a target, and one
    # whose blob is held by then is dropped at the commit. Digests stated here are deduplicated as usual.
    digests_later: bool = False


class PutPlan(Msg):
    put_id: str
    artifact_id: str
    # One entry per tensor (PutBegin's tensors sorted by name): where to write it, or None when the worker already
    # holds those bytes (dedup) or the tensor is empty. Empty when the whole artifact exists.
    segments: tuple[SegmentRef | None, ...] = ()
    # True: bytes go as PutData payloads over this connection instead of through shared memory.
    stream: bool = False
    exists: bool = False
    artifact: ArtifactInfo | None = None  # an inline put's committed record
    # A put begun with digests_later that needs its digests first (memory must be made room for, and the
    # worker may hold some of the bytes already; or its placement keeps no copy in memory): nothing was
    # reserved; begin it again with the digests.
    digests_first: bool = False


class PutData(Request[Ack]):
    """Payload frame: bytes ``[offset, offset + len(payload))`` of tensor ``index`` of a put."""

    put_id: str
    index: int
    offset: int


class PutCommit(Request["PutDone"]):
    put_id: str
    # A put begun with digests_later: every tensor's digest, in the order of PutBegin's tensors sorted by name
    # (the order of PutPlan.segments; otherwise empty).
    digests: tuple[str, ...] = ()


class PutAbort(Request[Ack]):
    put_id: str


class PutDone(Msg):
    artifact: ArtifactInfo


class ArtifactReply(Msg):
    """The reply to GetArtifact, CommitArtifact, RenewLease and RegisterCheckpoint."""

    artifact: ArtifactInfo


class MapTensors(Request["Mapped"]):
    """Same host: name the files holding an artifact's tensors so the caller maps them. Objects that may
    not be mapped (slab-arena slots, whose memory is reused) come back as None: read them instead."""
    idempotent: ClassVar[bool] = True

    artifact_id: str
    names: tuple[str, ...] = ()
    tier: str = ""  # "" = memory if present, else disk
    # A CUDA device ("cuda:N"): also export the worker's copies on that device, if it holds them.
    device: str = ""


class ReadCount(msgspec.Struct, frozen=True, kw_only=True):
    artifact_id: str
    reads: int
    nbytes: int


# Artifacts one ReportReads names at most (a caller with more reads to report sends several).
MAX_REPORTED_READS = 4096


class ReportReads(Request[Ack]):
    """Same host: reads a caller served from places this worker named before (``client.read_maps``), without
    asking again. The worker counts them as gets and as uses for its least-recently-used order."""

    reads: tuple[ReadCount, ...]


class Mapped(Msg):
    segments: tuple[SegmentRef | None, ...]
    # With MapTensors.device: one handle per name when the worker holds them all on that device, else ().
    cuda_ipc: tuple[CudaIpcHandle, ...] = ()


class Prefetch(Request["Prefetched"]):
    """Make sure ``worker_id`` holds a memory replica (pulled worker-to-worker); any worker routes it."""
    idempotent: ClassVar[bool] = True

    artifact_id: str
    worker_id: str
    pin_ttl: float | None = None
    pin: bool = False
    streams: int = 0  # parallel TCP streams per tensor; 0 = transport.streams / automatic
    # Materialize a view (e.g. one tensor-parallel rank's slices) as the artifact ``view_id`` instead.
    view: dict[str, tuple[SliceSpec, ...]] | None = None
    view_id: str = ""
    view_meta: dict[str, str] = {}
    # Also copy the result to this CUDA device of the worker ("cuda:N"), so that same-host callers map it
    # with CUDA IPC (the warm GPU hand-off). Refused with InvalidArgument by a worker without CUDA.
    device: str = ""


class Prefetched(Msg):
    worker_id: str
    already_present: bool
    source: str = ""  # worker id the bytes came from ("" = local disk tier or already present)
    source_tier: str = ""
    bytes_moved: int = 0
    seconds: float = 0.0
    retries: int = 0
    # The artifact's record as the worker saw it, with the new replica: callers need not read it again.
    artifact: ArtifactInfo | None = None


class RegisterCheckpoint(Request[ArtifactReply]):
    """Register a safetensors checkpoint (file or directory, readable by the worker) without reading it."""
    idempotent: ClassVar[bool] = True

    path: str
    key: str | None = None
    verify_checksums: bool = True


class Unpin(Request[Ack]):
    idempotent: ClassVar[bool] = True
    artifact_id: str
    worker_id: str


class Evict(Request[Ack]):
    """Drop ``worker_id``'s memory replica now (its disk copy, if any, stays). Pinned copies are unpinned."""
    idempotent: ClassVar[bool] = True

    artifact_id: str
    worker_id: str


class DropArtifact(Request[Ack]):
    """Gateway -> holder: forget this artifact's replica now (it was deleted)."""

    artifact_id: str


# --------------------------------------------------------------------------- data plane (transport.tcp)


class DataHello(Request["DataReply"]):
    """Opens a data-plane connection, as ``Hello`` does a control connection."""

    protocol_version: int
    role: str = ""
    nonce: bytes = b""
    peer_id: str = ""


class DataRequest(Request["DataReply"]):
    """Send bytes ``[offset, offset + length)`` of a tensor (after applying ``slices``, if any), in chunks
    each preceded by its 8-byte xxh3-64 checksum."""
    idempotent: ClassVar[bool] = True

    artifact_id: str
    name: str
    offset: int = 0
    length: int = -1
    slices: tuple[SliceSpec, ...] = ()
    chunk_bytes: int = 4 * 1024 * 1024
    tier: str = ""  # "" = any tier this worker holds


class DataReply(Msg):
    total: int  # bytes that follow (the requested range)
    chunk_bytes: int
    tier: str = "memory"


# --------------------------------------------------------------------------- metadata (GS; gateways forward)


class GetArtifact(Request[ArtifactReply]):
    idempotent: ClassVar[bool] = True
    key_or_id: str


class ListArtifacts(Request["ArtifactList"]):
    """One page of listing entries after the cursor: one per key under ``prefix``; with no prefix, one per
    key and then one per artifact bound to no key."""
    idempotent: ClassVar[bool] = True

    prefix: str = ""
    limit: int = 1000
    after: str = ""  # ArtifactList.next of the previous page


class ArtifactList(Msg):
    artifacts: tuple[ArtifactInfo, ...]
    next: str = ""  # the cursor of the next page; "" after the last
    # The key each entry is listed under ("" for an artifact bound to no key), one per entry of ``artifacts``.
    entry_keys: tuple[str, ...] = ()


class DeleteArtifact(Request["Deleted"]):
    """By key: unbind that key (the content goes only when nothing else refers to it). By id: delete the
    content outright, with every key."""

    key_or_id: str


class Deleted(Msg):
    artifact_id: str
    replicas: tuple[ReplicaInfo, ...] = ()  # the holders that drop it (when removed)
    removed: bool = True  # the artifact went (False: other references keep it)
    keys: tuple[str, ...] = ()  # when kept: the keys still naming it


class RenewLease(Request[ArtifactReply]):
    """Extend one leased reference: the binding of ``key``, or (None) the lease of puts without a key."""
    idempotent: ClassVar[bool] = True

    artifact_id: str
    ttl: float
    key: str | None = None


class ReleaseLease(Request[Deleted]):
    """End one leased reference (``key`` as in ``RenewLease``); the artifact goes if nothing else keeps it."""

    artifact_id: str
    key: str | None = None


class ListWorkers(Request["WorkerList"]):
    idempotent: ClassVar[bool] = True
    pass


class WorkerList(Msg):
    workers: tuple[WorkerInfo, ...]


# --------------------------------------------------------------------------- instances


class RegisterInstance(Request[Ack]):
    idempotent: ClassVar[bool] = True
    instance: InstanceInfo


class InstanceHeartbeat(Request[Ack]):
    idempotent: ClassVar[bool] = True
    instance_id: str
    running: int = 0
    waiting: int = 0
    kv_tokens_used: int = 0
    kv_tokens_capacity: int = 0


class ListInstances(Request["InstanceList"]):
    idempotent: ClassVar[bool] = True
    pass


class InstanceList(Msg):
    instances: tuple[InstanceInfo, ...]


class InstanceCall(Request["InstanceReply"]):
    """Gateway -> instance runtime: run one instance operation through the adaptor.

    ``op``: publish | hydrate | transform_into | engine (an engine-specific command in ``args``)."""

    instance_id: str
    op: str
    request_id: str = ""
    artifacts: tuple[str, ...] = ()
    args: dict[str, Any] = {}


class InstanceReply(Msg):
    artifacts: tuple[str, ...] = ()
    result: dict[str, Any] = {}


# --------------------------------------------------------------------------- plans


class RunPlan(Request["PlanResult"]):
    steps: tuple[StepSpec, ...]
    concurrency: int = 4
    idempotency_key: str | None = None


class PlanResult(Msg):
    plan_id: str
    status: str  # succeeded | failed
    steps: tuple[StepResult, ...]
    # Steps whose results came from an earlier run with the same idempotency key.
    reused: tuple[str, ...] = ()


# --------------------------------------------------------------------------- worker <-> GS


class RegisterWorker(Request["Registered"]):
    idempotent: ClassVar[bool] = True
    worker: WorkerInfo


class Registered(Msg):
    incarnation: int


class Heartbeat(Request["HeartbeatReply"]):
    idempotent: ClassVar[bool] = True
    worker_id: str
    incarnation: int
    load: WorkerLoad
    # Artifact ids this worker dropped since the last heartbeat (acknowledges HeartbeatReply.drop).
    dropped: tuple[str, ...] = ()


class HeartbeatReply(Msg):
    # Artifacts deleted or expired that this worker still holds: drop them.
    drop: tuple[str, ...] = ()
    # The GS does not know this worker (e.g. its database was replaced): register again.
    reregister: bool = False


class CommitArtifact(Request[ArtifactReply]):
    """A worker holds a complete replica: record the artifact (if new), its key and the replica."""
    idempotent: ClassVar[bool] = True

    artifact: ArtifactInfo
    worker_id: str
    key: str | None = None
    ttl: float | None = None
    tiers: tuple[str, ...] = ("memory",)
    # Announced after the worker restarted: refused (NotFound) if the artifact was deleted meanwhile.
    restored: bool = False


class AddReplica(Request[Ack]):
    """A worker holds (another tier of) an existing artifact; ownership and keys are untouched."""
    idempotent: ClassVar[bool] = True

    artifact_id: str
    worker_id: str
    tiers: tuple[str, ...] = ("memory",)
    restored: bool = False  # announced after a restart: refused if this worker owes a drop of it


class RemoveReplica(Request[Ack]):
    idempotent: ClassVar[bool] = True
    artifact_id: str
    worker_id: str
    tier: str = "memory"


class ListUnderReplicated(Request["UnderReplicated"]):
    """The artifacts with fewer copies on live workers than their placement wants (``ArtifactInfo.copies`` <
    ``replicas_wanted``): only those with a replica on ``holder`` when it is given, at most ``limit``."""
    idempotent: ClassVar[bool] = True

    holder: str = ""
    limit: int = 100


class UnderReplicated(Msg):
    artifacts: tuple[ArtifactInfo, ...] = ()
    missing: int = 0  # copies missing in all (of the holder's artifacts, when one was named), listed or not
