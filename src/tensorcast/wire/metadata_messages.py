"""The artifact metadata a caller reads and changes: look-ups, listing, deletion and leased references (the
global store answers; gateways forward).

Owns: ``ArtifactReply`` (the reply of every request that returns one artifact's record), ``GetArtifact``,
``ListArtifacts``, ``DeleteArtifact``, ``RenewLease`` and ``ReleaseLease`` with their replies, and ``RevokeReads``
(the store to a gateway answering look-ups under a read lease: ``gs.read_leases``). Does not own:
moving bytes (``wire.artifact_messages``), the workers' bookkeeping with the store
(``wire.cluster_messages``), or the tables derived from the messages (``wire.protocol``).
"""

from __future__ import annotations

from typing import ClassVar

from tensorcast.records import ArtifactInfo, ReplicaInfo, SegmentRef
from tensorcast.wire.message_base import Msg, Request
from tensorcast.wire.session_messages import Ack

# --------------------------------------------------------------------------- metadata (GS; gateways forward)


class ArtifactReply(Msg):
    """The reply to GetArtifact, CommitArtifact, RenewLease and RegisterCheckpoint."""

    artifact: ArtifactInfo
    # GetArtifact with ``map``: where the relaying worker (``mapped_by``) holds each tensor of ``artifact`` in
    # memory, in the order of ``artifact.tensors`` (as ``Mapped.segments``: None, read it instead); () if not.
    segments: tuple[SegmentRef | None, ...] = ()
    mapped_by: str = ""
    # GetArtifact with ``read_lease``, granted: for this long from the request, the asking worker may answer
    # look-ups of this id itself (0: not granted).
    read_lease_seconds: float = 0.0


class GetArtifact(Request[ArtifactReply]):
    """The artifact a key points at, or with this id. ``map``: a same-host caller that will read it asks the
    gateway to name its memory copy's places too (``MapTensors``' answer, saving that call), when it holds one
    whose bytes need no check first; the global store ignores it."""
    idempotent: ClassVar[bool] = True
    key_or_id: str
    map: bool = False
    # Set by a gateway holding the artifact's checked memory copy (a worker's credential, an id): the store
    # grants it a read lease, under which it answers this id's later look-ups itself (``gs.read_leases``).
    read_lease: bool = False


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


class RevokeReads(Request[Ack]):
    """Store -> a gateway holding read leases on these artifacts (deleted, released or expired): stop answering
    their look-ups yourself now; the next one asks the store. ``worker_id``: the holder (another worker that now
    answers at its address refuses it)."""

    artifact_ids: tuple[str, ...]
    worker_id: str = ""
