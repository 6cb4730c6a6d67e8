"""The KV-page messages: shard leases between shard homes and the global store, and page operations
between callers and shard homes (plus the benchmark-only page index and the store's request counters).

Owns: their types, built from ``records`` on the ``wire.message_base.Msg`` base. Does not own: the envelope,
the union or the reply table (``wire.protocol``), or their handlers (``kv.home``, ``gs.service``).
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

from tensorcast.records import ShardLease, SlotList
from tensorcast.wire.message_base import Msg, Request
from tensorcast.wire.session_messages import Ack


class ListShards(Request["ShardTable"]):
    """The lease table; with ``since``/``epoch`` from an earlier reply of the same global store, only the
    leases changed since (a shard home following the table every half second reads deltas, not the table)."""
    idempotent: ClassVar[bool] = True

    since: int = 0
    epoch: str = ""


class ShardTable(Msg):
    num_shards: int
    leases: tuple[ShardLease, ...]
    now: float  # the global store's clock, to compare expiries with
    revision: int = 0  # pass back as ListShards.since, with the epoch
    epoch: str = ""  # the answering global store's numbering; another store's starts over
    full: bool = True  # False: ``leases`` holds only those changed since ``since``


class AcquireShards(Request["ShardGrants"]):
    idempotent: ClassVar[bool] = True
    worker_id: str
    shards: tuple[int, ...]
    ttl: float


class RenewShards(Request["ShardGrants"]):
    idempotent: ClassVar[bool] = True
    worker_id: str
    shards: tuple[int, ...]
    tokens: tuple[int, ...]
    ttl: float


class ReleaseShards(Request["ShardGrants"]):
    idempotent: ClassVar[bool] = True
    worker_id: str
    shards: tuple[int, ...]
    tokens: tuple[int, ...]


class ShardGrants(Msg):
    """The leases granted or renewed (others were refused)."""

    leases: tuple[ShardLease, ...]


class KVPut(Request["KVPutReply"]):
    """Store pages (payload: their bytes back to back, ``sizes`` each). ``tokens``: fencing token per shard."""

    keys: tuple[str, ...]
    sizes: tuple[int, ...]
    tokens: dict[int, int]
    ttl: float | None = None
    # Same host: no payload; the reply names reserved slots, the caller copies into them, then KVCommit.
    same_host: bool = False


class KVPutReply(Msg):
    stored: int
    slots: SlotList | None = None  # same_host: where to write each page (arena -1: already present)
    reservation: str = ""


class KVCommit(Request[KVPutReply]):
    """Same host: the caller wrote the reserved slots; make the pages visible (fencing checked again)."""

    reservation: str
    keys: tuple[str, ...]
    tokens: dict[int, int]


class KVGet(Request["KVGetReply"]):
    idempotent: ClassVar[bool] = True
    keys: tuple[str, ...]
    tokens: dict[int, int]
    # Same host: no payload; the reply names the slots (held under a read lease until released).
    same_host: bool = False
    # Read leases of earlier same-host gets that the caller is done with (saves a KVRelease round trip).
    release: tuple[str, ...] = ()


class KVGetReply(Msg):
    """``sizes[i]`` bytes of page i follow in the payload, or -1 for a miss."""

    sizes: tuple[int, ...]
    slots: SlotList | None = None  # same_host: where each hit is, held under ``lease`` until KVRelease
    lease: str = ""


class KVRelease(Request[Ack]):
    leases: tuple[str, ...]


class KVExists(Request["KVExistsReply"]):
    idempotent: ClassVar[bool] = True
    keys: tuple[str, ...]
    tokens: dict[int, int]


class KVExistsReply(Msg):
    present: bytes  # one byte per key: 1 present, 0 missing
    # The home's presence table (kv.presence): a same-host caller maps it and answers later lookups itself.
    presence: str = ""


class KVHandoff(Request["KVPages"]):
    """A home granted ``tokens``' shards asks another home for the pages it kept of them. Without ``tenures``,
    a probe: the reply names, per shard, the tenure (fencing token) of the pages kept there. With them, one
    batch (at most ``max_bytes``) of each shard's pages of that tenure, after the cursor ``(after_shard,
    after_key)``; the cursor also acknowledges every page up to it: the asked home drops those once the global
    store's table confirms the grant."""
    idempotent: ClassVar[bool] = True

    worker_id: str
    tokens: dict[int, int]
    tenures: dict[int, int] = msgspec.field(default_factory=dict)
    after_shard: int = -1
    after_key: str = ""
    max_bytes: int = 0
    # The asker has taken what it needed of these shards (sent to every home it probed, chosen or not): what
    # the asked home keeps of them is no longer anyone's, once the lease table confirms the grant.
    done: bool = False


class KVPages(Msg):
    """Pages between shard homes (a hand-over batch, or copies to a backup): ``sizes[i]`` bytes of page i
    follow in the payload, ``ttls[i]`` seconds of its TTL are left (inf: none). As a request (``KVReplicate``'s
    reply is ``KVPutReply``), ``tokens`` are the sender's leases of the pages' shards."""

    keys: tuple[str, ...]
    sizes: tuple[int, ...]
    ttls: tuple[float, ...]
    tenures: dict[int, int] = msgspec.field(default_factory=dict)  # a probe's answer: shard -> tenure (0: none)


class KVReplicate(Request[KVPutReply]):
    """The holder of ``tokens``' shards copies pages it stored to one of their backup homes (``kv.replicas``);
    the bytes follow in the payload."""
    idempotent: ClassVar[bool] = True

    worker_id: str
    tokens: dict[int, int]
    keys: tuple[str, ...]
    sizes: tuple[int, ...]
    ttls: tuple[float, ...]


class KVShardsReleased(Request[Ack]):
    """A home gave ``shards`` back (``leaving``: all of its shards, it is stopping): the home told reads the
    lease table now instead of at its next tick, and while ``leaving`` counts the sender out of the homes."""
    idempotent: ClassVar[bool] = True

    worker_id: str
    shards: tuple[int, ...]
    leaving: bool = False


class GSStats(Request["GSStatsReply"]):
    idempotent: ClassVar[bool] = True
    pass


class GSStatsReply(Msg):
    requests: dict[str, int]
    metrics_url: str = ""  # where the answering global store serves metrics and the dashboard
    stores: dict[str, str] = msgspec.field(default_factory=dict)  # every live global store: address -> URL


class PageIndexPut(Request[Ack]):
    """Benchmark switch only: record page locations in the global store (what shard homes avoid)."""
    idempotent: ClassVar[bool] = True

    keys: tuple[str, ...]
    worker_id: str


class PageIndexGet(Request["PageIndexReply"]):
    idempotent: ClassVar[bool] = True
    keys: tuple[str, ...]


class PageIndexReply(Msg):
    holders: tuple[str, ...]  # "" = unknown
