"""The cluster's own bookkeeping with the global store: worker membership, heartbeats, replicas and
under-replication.

Owns: ``ListWorkers``, ``RegisterWorker``, ``Heartbeat``, ``CommitArtifact`` (and ``CommitArtifacts``, several
at once), ``AddReplica``, ``RemoveReplica`` and ``ListUnderReplicated`` with their replies. Does not own: what
callers ask of artifacts (``wire.artifact_messages``, ``wire.metadata_messages``), the KV shard leases
(``wire.kv_messages``), or the tables derived from the messages (``wire.protocol``).
"""

from __future__ import annotations

from typing import ClassVar

from tensorcast.records import ArtifactInfo, WorkerInfo, WorkerLoad
from tensorcast.wire.message_base import Msg, Request
from tensorcast.wire.metadata_messages import ArtifactReply
from tensorcast.wire.session_messages import Ack

# --------------------------------------------------------------------------- membership (GS; gateways forward)


class ListWorkers(Request["WorkerList"]):
    idempotent: ClassVar[bool] = True
    pass


class WorkerList(Msg):
    workers: tuple[WorkerInfo, ...]


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


class CommitArtifacts(Request["CommitsDone"]):
    """Several ``CommitArtifact`` of one worker sent together (a group commit, ``worker.commit_group``): the
    store records them in one transaction, made durable once if any of them needs it, and answers each on its
    own (``CommitsDone.outcomes``, in order)."""
    idempotent: ClassVar[bool] = True

    commits: tuple[CommitArtifact, ...]


class CommitOutcome(Msg):
    """One commit's answer: the artifact as recorded, or the code and message of the error it met."""

    artifact: ArtifactInfo | None = None
    code: str = ""
    message: str = ""


class CommitsDone(Msg):
    outcomes: tuple[CommitOutcome, ...]


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
