"""The records every layer shares: what a tensor, an artifact, a replica, a worker, a slice or a placement is.

Owns: plain, frozen msgspec Structs with no behaviour beyond checking their own invariants
(``Placement.validate``) and counts derived from their own fields (``ArtifactInfo.copies``). They sit on the
ground floor: storage (``pool``), identity (``tensors``, ``views``), weights, the pure KV rules and the
protocol (``wire.messages`` builds its messages from them) all import this module, and it imports nothing of
TensorCast but ``errors``. Does not own: any message, frame or connection (``wire``), or what is done with a
record.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import msgspec

from tensorcast.errors import InvalidArgument, clip

__all__ = ["ArtifactInfo", "CudaIpcHandle", "InstanceInfo", "Need", "Overflow", "Placement", "ReplicaInfo",
           "SegmentRef", "ShardLease", "SliceSpec", "SlotList", "StepResult", "StepSpec", "TensorMeta",
           "WorkerInfo", "WorkerLoad"]


class _Rec(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    pass


class TensorMeta(_Rec):
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    digest: str


class ReplicaInfo(_Rec):
    worker_id: str
    address: str = ""
    host_id: str = ""
    tier: str = "memory"
    alive: bool = True
    data_address: str = ""


class ArtifactInfo(_Rec):
    """An artifact's record: identity, tensors, ownership, keys and where its replicas are."""

    id: str
    tensors: tuple[TensorMeta, ...]
    nbytes: int
    keys: tuple[str, ...] = ()
    owner: Literal["system", "lease"] = "system"
    lease_expiry: float | None = None
    created_at: float = 0.0
    replicas: tuple[ReplicaInfo, ...] = ()
    policy: str = "cache"
    # Descriptive metadata: for checkpoints registered with from_disk, "source", "format", "model_type",
    # "config" (config.json as JSON); for materialized views, "view_of" and "view".
    meta: dict[str, str] = {}
    # Copies its placement wants on distinct live workers (Placement.replicas; the strongest of the puts).
    replicas_wanted: int = 1

    @property
    def copies(self) -> int:
        """Distinct live workers holding a replica (any tier), as of this record: compare with
        ``replicas_wanted``."""
        return len({r.worker_id for r in self.replicas if r.alive})


class WorkerLoad(_Rec):
    """A worker's load as its heartbeat reports it (the global store keeps the latest; ``WorkerInfo`` carries
    it): the one declaration of these fields, from the worker's gauges to the store's columns."""

    memory_used: int = 0
    memory_capacity: int = 0
    artifacts: int = 0
    disk_used: int = 0
    disk_capacity: int = 0
    # Network pressure, averaged over the last heartbeat interval.
    net_in_bps: float = 0.0
    net_out_bps: float = 0.0
    transfers_in_flight: int = 0
    # Pre-faulted shared memory ready for fills (beyond memory_capacity; config worker.prefault_bytes).
    memory_prefaulted: int = 0
    # Plans this worker's gateway role is running now.
    plans_in_flight: int = 0


class WorkerInfo(WorkerLoad, kw_only=True):
    """A worker as the global store knows it: identity, liveness and its latest load (``WorkerLoad``)."""

    worker_id: str
    address: str
    host_id: str
    roles: tuple[str, ...]
    pid: int = 0
    incarnation: int = 0
    alive: bool = True
    last_heartbeat: float = 0.0
    registered_at: float = 0.0
    data_address: str = ""
    # Where this worker serves Prometheus metrics ("" when metrics are off).
    metrics_url: str = ""
    # Where its shard home publishes KV events and answers replays (kv.events_endpoint and
    # kv.events_replay_endpoint as bound; "" when off).
    kv_events_url: str = ""
    kv_events_replay_url: str = ""

    @property
    def load(self) -> WorkerLoad:
        return WorkerLoad(**{f: getattr(self, f) for f in WorkerLoad.__struct_fields__})


class InstanceInfo(_Rec):
    """An engine instance attached to a home worker, with its load (the rebalancing signal)."""

    instance_id: str
    address: str
    home_worker: str
    running: int = 0
    waiting: int = 0
    kv_tokens_used: int = 0
    kv_tokens_capacity: int = 0
    alive: bool = True
    last_heartbeat: float = 0.0
    engine: str = ""
    metrics_url: str = ""


class SliceSpec(_Rec):
    """``tensor[..., start:stop:step, ...]`` on dimension ``dim``; or, when ``ranges`` is set, the
    concatenation of ``tensor[..., a:b, ...]`` for each ``(a, b)`` (one rank's part of a fused tensor)."""

    dim: int
    start: int
    stop: int
    step: int = 1
    ranges: tuple[tuple[int, int], ...] = ()


class SegmentRef(_Rec):
    """A mapped file (shared-memory segment or disk-tier blob) holding one tensor's bytes at ``offset``."""

    path: str
    size: int
    offset: int = 0
    tier: str = "memory"


class CudaIpcHandle(_Rec):
    """A CUDA tensor a worker holds, exported for a process on the same host (``cudaIpcGetMemHandle`` with
    torch's reference counting): what ``torch.multiprocessing`` would pickle, as plain fields."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    tensor_offset: int
    dtype: str
    device: int
    storage_handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None = None
    event_sync_required: bool = False


class ShardLease(_Rec):
    shard: int
    holder: str  # "" when vacant
    token: int  # fencing token: increments on every change of holder
    expiry: float  # global-store clock
    acquired_at: float = 0.0
    address: str = ""  # the holder's RPC address
    host_id: str = ""  # the holder's host, for same-host (shared-memory) page access


class SlotList(_Rec):
    """Same host: where pages are, compactly (no struct per page). ``arenas`` are shared-memory files;
    ``slots`` holds little-endian int64 triples (arena index, offset, size), one per page in order; a
    page without a slot (a miss, or already stored) has arena index -1."""

    arenas: tuple[str, ...] = ()
    slots: bytes = b""


class StepSpec(_Rec):
    """One plan step. Arguments may hold ``{"$ref": step_id}``: that step's output (artifact ids)."""

    id: str
    op: str
    args: dict[str, Any] = {}
    after: tuple[str, ...] = ()


class StepResult(_Rec):
    id: str
    op: str
    status: str  # succeeded | failed | skipped
    output: tuple[str, ...] = ()
    result: dict[str, Any] = {}
    error_code: str = ""
    error: str = ""
    retryable: bool = False
    attempts: int = 0
    started: float = 0.0
    finished: float = 0.0


Need = Literal["required", "preferred", "none"]
Overflow = Literal["evict", "spill", "reject"]


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    """Where an artifact lives and what a put does when memory is full. ``overflow``: ``evict``
    least-recently used evictable replicas, ``spill`` to the disk tier only, ``reject`` with
    ``ResourceExhausted``. The named presets are in ``pool.placement``."""

    name: str = "custom"
    memory: Need = "preferred"
    disk: Literal["required", "none"] = "none"
    replicas: int = 1
    overflow: Overflow = "evict"
    evictable: bool = True
    # Drop the memory copy this many seconds after the put (the disk copy stays). None: keep.
    memory_ttl: float | None = None

    def validate(self) -> Placement:
        if self.memory not in ("required", "preferred", "none"):
            raise InvalidArgument(f"placement.memory must be required/preferred/none, got {clip(self.memory)}")
        if self.disk not in ("required", "none"):
            raise InvalidArgument(f"placement.disk must be required/none, got {clip(self.disk)}")
        if self.overflow not in ("evict", "spill", "reject"):
            raise InvalidArgument(f"placement.overflow must be evict/spill/reject, got {clip(self.overflow)}")
        if self.memory == "none" and self.disk == "none":
            raise InvalidArgument("placement keeps no copy: memory and disk are both 'none'")
        if not 1 <= self.replicas <= 16:
            raise InvalidArgument(f"placement.replicas must be 1..16, got {self.replicas}")
        if self.replicas > 1 and self.memory == "none":
            raise InvalidArgument("extra replicas are memory replicas: memory may not be 'none'")
        if self.overflow == "spill" and self.memory == "required":
            raise InvalidArgument("overflow 'spill' contradicts memory 'required'")
        if self.memory_ttl is not None and (not isinstance(self.memory_ttl, int | float) or
                                            not math.isfinite(self.memory_ttl) or self.memory_ttl <= 0 or
                                            self.disk != "required"):
            raise InvalidArgument("memory_ttl needs a finite positive number of seconds and disk 'required'")
        return self

    @property
    def wants_memory(self) -> bool:
        return self.memory != "none"
