"""The order in which a reader tries an artifact's replicas (pure).

Owns: ``rank_sources``, the one ranking both readers use, a caller's ``Reader`` (``client.reads``) and a
worker pulling from its peers (``worker.fetch``), with the source preferences a caller may name
(``SOURCES``). Does not own: which replicas a reader can reach at all (each reader filters on liveness and
on the address it needs) or failing over between them.
"""

from __future__ import annotations

from collections.abc import Iterable

from tensorcast.errors import InvalidArgument, clip
from tensorcast.records import ReplicaInfo

__all__ = ["SOURCES", "rank_sources"]

# auto: this host's replicas first (mapped, or read through loopback), memory before disk within each;
# prefer_p2p: memory anywhere before any disk (a peer's memory beats a disk read), this host first;
# prefer_disk: disk copies first (to spare busy holders' memory bandwidth), this host first;
# local_only: this host's replicas only, memory first.
SOURCES = ("auto", "local_only", "prefer_p2p", "prefer_disk")


def rank_sources(replicas: Iterable[ReplicaInfo], local_host: str, source: str = "auto") -> list[ReplicaInfo]:
    """``replicas`` in the order to try them for a reader on ``local_host``; ties keep their given order."""
    if source not in SOURCES:
        raise InvalidArgument(f"source must be one of {SOURCES}, got {clip(source)}")
    candidates = [r for r in replicas if source != "local_only" or r.host_id == local_host]

    def rank(r: ReplicaInfo) -> tuple[bool, bool]:
        remote, disk = r.host_id != local_host, r.tier == "disk"
        if source == "prefer_p2p":
            return (disk, remote)
        if source == "prefer_disk":
            return (not disk, remote)
        return (remote, disk)

    return sorted(candidates, key=rank)
