"""What a caller asks a worker to do with an artifact's bytes: puts, same-host maps and read reports,
prefetches (and views), checkpoint registration, unpinning and eviction.

Owns: those requests and their replies, and ``DropArtifact`` (a gateway telling a holder to forget a deleted
artifact). Does not own: the artifact metadata requests (``wire.metadata_messages``, whose ``ArtifactReply``
these use), the data plane's range request (``wire.session_messages``), or the tables derived from the
messages (``wire.protocol``).
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

from tensorcast.records import ArtifactInfo, CudaIpcHandle, Placement, SegmentRef, SliceSpec, TensorMeta
from tensorcast.wire.message_base import Msg, Request
from tensorcast.wire.metadata_messages import ArtifactReply
from tensorcast.wire.session_messages import Ack

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
