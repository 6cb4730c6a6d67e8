"""Every message TensorCast processes exchange, as frozen, tagged msgspec Structs.

Owns: the message types and the records they carry. A frame's body is an ``Envelope`` (request id, kind,
trace id, absolute deadline) whose ``body`` is one of ``Message``; decoding an unknown tag fails cleanly.
Does not own: framing and connections (``wire.frames``, ``wire.rpc``) or what a handler does.

Adding a message: define a Struct with ``tag=True`` here, add it to ``Message``, register a handler.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tensorcast.records import (
    ArtifactInfo,
    CudaIpcHandle,
    InstanceInfo,
    Placement,
    ReplicaInfo,
    SegmentRef,
    ShardLease,
    SliceSpec,
    SlotList,
    StepResult,
    StepSpec,
    TensorMeta,
    WorkerInfo,
)

# 2: records moved out of messages; ArtifactInfo travels inside ArtifactReply; payload checksums.
PROTOCOL_VERSION = 2


class _Msg(msgspec.Struct, frozen=True, tag=True, kw_only=True, omit_defaults=True):
    pass


# --------------------------------------------------------------------------- connection set-up


class Hello(_Msg):
    protocol_version: int
    token: str | None = None
    peer_id: str = ""
    host_id: str = ""


class Welcome(_Msg):
    protocol_version: int
    server_id: str
    host_id: str
    roles: tuple[str, ...] = ()


# --------------------------------------------------------------------------- generic replies


class Ack(_Msg):
    pass


class ErrorReply(_Msg):
    code: str
    message: str
    retryable: bool = False


# --------------------------------------------------------------------------- caller <-> worker


class PutBegin(_Msg):
    """Start storing an artifact. The worker answers with a ``PutPlan``."""

    tensors: tuple[TensorMeta, ...]
    key: str | None = None
    ttl: float | None = None
    # The caller can map this worker's shared memory (same host id and reachable /dev/shm).
    same_host: bool = False
    # A preset name ("cache", "durable", "ha", "cold", "warm", "pinned") or a general Placement.
    placement: str | Placement | None = None


class PutPlan(_Msg):
    put_id: str
    artifact_id: str
    # One entry per tensor (in PutBegin order): where to write it, or None when the worker already
    # holds those bytes (dedup) or the tensor is empty. Empty when the whole artifact exists.
    segments: tuple[SegmentRef | None, ...] = ()
    # True: bytes go as PutData payloads over this connection instead of through shared memory.
    stream: bool = False
    exists: bool = False


class PutData(_Msg):
    """Payload frame: bytes ``[offset, offset + len(payload))`` of tensor ``index`` of a put."""

    put_id: str
    index: int
    offset: int


class PutCommit(_Msg):
    put_id: str


class PutAbort(_Msg):
    put_id: str


class PutDone(_Msg):
    artifact: ArtifactInfo


class ArtifactReply(_Msg):
    """The reply to GetArtifact, CommitArtifact, RenewLease and RegisterCheckpoint."""

    artifact: ArtifactInfo


class MapTensors(_Msg):
    """Same host: name the files holding an artifact's tensors so the caller maps them. Objects that may
    not be mapped (slab-arena slots, whose memory is reused) come back as None: read them instead."""

    artifact_id: str
    names: tuple[str, ...] = ()
    tier: str = ""  # "" = memory if present, else disk
    # A CUDA device ("cuda:N"): also export the worker's copies on that device, if it holds them.
    device: str = ""


class Mapped(_Msg):
    segments: tuple[SegmentRef | None, ...]
    # With MapTensors.device: one handle per name when the worker holds them all on that device, else ().
    cuda_ipc: tuple[CudaIpcHandle, ...] = ()


class Prefetch(_Msg):
    """Make sure ``worker_id`` holds a memory replica (pulled worker-to-worker); any worker routes it."""

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


class Prefetched(_Msg):
    worker_id: str
    already_present: bool
    source: str = ""  # worker id the bytes came from ("" = local disk tier or already present)
    source_tier: str = ""
    bytes_moved: int = 0
    seconds: float = 0.0
    retries: int = 0


class RegisterCheckpoint(_Msg):
    """Register a safetensors checkpoint (file or directory, readable by the worker) without reading it."""

    path: str
    key: str | None = None
    verify_checksums: bool = True


class Unpin(_Msg):
    artifact_id: str
    worker_id: str


class Evict(_Msg):
    """Drop ``worker_id``'s memory replica now (its disk copy, if any, stays). Pinned copies are unpinned."""

    artifact_id: str
    worker_id: str


class DropArtifact(_Msg):
    """Gateway -> holder: forget this artifact's replica now (it was deleted)."""

    artifact_id: str


# --------------------------------------------------------------------------- data plane (transport.tcp)


class DataHello(_Msg):
    protocol_version: int
    token: str | None = None


class DataRequest(_Msg):
    """Send bytes ``[offset, offset + length)`` of a tensor (after applying ``slices``, if any), in chunks
    each preceded by its 8-byte xxh3-64 checksum."""

    artifact_id: str
    name: str
    offset: int = 0
    length: int = -1
    slices: tuple[SliceSpec, ...] = ()
    chunk_bytes: int = 4 * 1024 * 1024
    tier: str = ""  # "" = any tier this worker holds


class DataReply(_Msg):
    total: int  # bytes that follow (the requested range)
    chunk_bytes: int
    tier: str = "memory"


# --------------------------------------------------------------------------- metadata (GS; gateways forward)


class GetArtifact(_Msg):
    key_or_id: str


class ListArtifacts(_Msg):
    prefix: str = ""
    limit: int = 10_000


class ArtifactList(_Msg):
    artifacts: tuple[ArtifactInfo, ...]


class DeleteArtifact(_Msg):
    key_or_id: str


class Deleted(_Msg):
    artifact_id: str
    replicas: tuple[ReplicaInfo, ...] = ()


class RenewLease(_Msg):
    artifact_id: str
    ttl: float


class ReleaseLease(_Msg):
    artifact_id: str


class ListWorkers(_Msg):
    pass


class WorkerList(_Msg):
    workers: tuple[WorkerInfo, ...]


# --------------------------------------------------------------------------- instances


class RegisterInstance(_Msg):
    instance: InstanceInfo


class InstanceHeartbeat(_Msg):
    instance_id: str
    running: int = 0
    waiting: int = 0
    kv_tokens_used: int = 0
    kv_tokens_capacity: int = 0


class ListInstances(_Msg):
    pass


class InstanceList(_Msg):
    instances: tuple[InstanceInfo, ...]


class InstanceCall(_Msg):
    """Gateway -> instance runtime: run one instance operation through the adaptor.

    ``op``: publish | hydrate | transform_into | engine (an engine-specific command in ``args``)."""

    instance_id: str
    op: str
    request_id: str = ""
    artifacts: tuple[str, ...] = ()
    args: dict[str, Any] = {}


class InstanceReply(_Msg):
    artifacts: tuple[str, ...] = ()
    result: dict[str, Any] = {}


# --------------------------------------------------------------------------- KV pages and shard leases


class ListShards(_Msg):
    pass


class ShardTable(_Msg):
    num_shards: int
    leases: tuple[ShardLease, ...]
    now: float  # the global store's clock, to compare expiries with


class AcquireShards(_Msg):
    worker_id: str
    shards: tuple[int, ...]
    ttl: float


class RenewShards(_Msg):
    worker_id: str
    shards: tuple[int, ...]
    tokens: tuple[int, ...]
    ttl: float


class ReleaseShards(_Msg):
    worker_id: str
    shards: tuple[int, ...]
    tokens: tuple[int, ...]


class ShardGrants(_Msg):
    """The leases granted or renewed (others were refused)."""

    leases: tuple[ShardLease, ...]


class KVPut(_Msg):
    """Store pages (payload: their bytes back to back, ``sizes`` each). ``tokens``: fencing token per shard."""

    keys: tuple[str, ...]
    sizes: tuple[int, ...]
    tokens: dict[int, int]
    ttl: float | None = None
    # Same host: no payload; the reply names reserved slots, the caller copies into them, then KVCommit.
    same_host: bool = False


class KVPutReply(_Msg):
    stored: int
    slots: SlotList | None = None  # same_host: where to write each page (arena -1: already present)
    reservation: str = ""


class KVCommit(_Msg):
    """Same host: the caller wrote the reserved slots; make the pages visible (fencing checked again)."""

    reservation: str
    keys: tuple[str, ...]
    tokens: dict[int, int]


class KVGet(_Msg):
    keys: tuple[str, ...]
    tokens: dict[int, int]
    # Same host: no payload; the reply names the slots (held under a read lease until released).
    same_host: bool = False
    # Read leases of earlier same-host gets that the caller is done with (saves a KVRelease round trip).
    release: tuple[str, ...] = ()


class KVGetReply(_Msg):
    """``sizes[i]`` bytes of page i follow in the payload, or -1 for a miss."""

    sizes: tuple[int, ...]
    slots: SlotList | None = None  # same_host: where each hit is, held under ``lease`` until KVRelease
    lease: str = ""


class KVRelease(_Msg):
    leases: tuple[str, ...]


class KVExists(_Msg):
    keys: tuple[str, ...]
    tokens: dict[int, int]


class KVExistsReply(_Msg):
    present: bytes  # one byte per key: 1 present, 0 missing


class GSStats(_Msg):
    pass


class GSStatsReply(_Msg):
    requests: dict[str, int]


class PageIndexPut(_Msg):
    """Benchmark switch only: record page locations in the global store (what shard homes avoid)."""

    keys: tuple[str, ...]
    worker_id: str


class PageIndexGet(_Msg):
    keys: tuple[str, ...]


class PageIndexReply(_Msg):
    holders: tuple[str, ...]  # "" = unknown


# --------------------------------------------------------------------------- plans


class RunPlan(_Msg):
    steps: tuple[StepSpec, ...]
    concurrency: int = 4
    idempotency_key: str | None = None


class PlanResult(_Msg):
    plan_id: str
    status: str  # succeeded | failed
    steps: tuple[StepResult, ...]
    # Steps whose results came from an earlier run with the same idempotency key.
    reused: tuple[str, ...] = ()


# --------------------------------------------------------------------------- worker <-> GS


class RegisterWorker(_Msg):
    worker: WorkerInfo


class Registered(_Msg):
    incarnation: int


class Heartbeat(_Msg):
    worker_id: str
    incarnation: int
    memory_used: int
    memory_capacity: int
    artifacts: int
    disk_used: int = 0
    disk_capacity: int = 0
    net_in_bps: float = 0.0
    net_out_bps: float = 0.0
    transfers_in_flight: int = 0
    memory_prefaulted: int = 0
    # Artifact ids this worker dropped since the last heartbeat (acknowledges HeartbeatReply.drop).
    dropped: tuple[str, ...] = ()


class HeartbeatReply(_Msg):
    # Artifacts deleted or expired that this worker still holds: drop them.
    drop: tuple[str, ...] = ()
    # The GS does not know this worker (e.g. its database was replaced): register again.
    reregister: bool = False


class CommitArtifact(_Msg):
    """A worker holds a complete replica: record the artifact (if new), its key and the replica."""

    artifact: ArtifactInfo
    worker_id: str
    key: str | None = None
    ttl: float | None = None
    tiers: tuple[str, ...] = ("memory",)


class AddReplica(_Msg):
    """A worker holds (another tier of) an existing artifact; ownership and keys are untouched."""

    artifact_id: str
    worker_id: str
    tiers: tuple[str, ...] = ("memory",)


class RemoveReplica(_Msg):
    artifact_id: str
    worker_id: str
    tier: str = "memory"


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
