"""How a Distributed Checkpoint is laid out in TensorCast, and which checkpoints of a run to collect (pure).

Owns: the keys of a checkpoint's bundle (its manifest under the checkpoint's key, one artifact per saving
rank under ``KEY/.rank-NNNNN``, read marks under ``KEY/.reading-*``), the tensor name a DCP write item gets
inside its rank's artifact, the slices a read item takes of a stored chunk, grouping read items so that one
view names each stored tensor once, the two placements of a save (memory replicas first, then the caller's
placement with its disk copy), the worker a rank writes to, and which older checkpoints ``keep_last``
collects. Does not own: any I/O (``integrations.torch_dcp`` does it) or DCP's planning.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgspec

from tensorcast.records import Placement, WorkerInfo
from tensorcast.weights.dcp_files import chunk_name

__all__ = ["METADATA_TENSOR", "CheckpointEntry", "Stored", "collectable", "is_bundle_member", "item_name",
           "memory_first", "rank_key", "read_rounds", "read_slices", "reading_prefix", "run_prefix",
           "writer_worker"]

# The manifest artifact holds DCP's pickled ``Metadata`` as one uint8 tensor of this name.
METADATA_TENSOR = "dcp.metadata"
_RANK = "/.rank-"
_READING = "/.reading-"


@dataclass(frozen=True, slots=True)
class Stored:
    """Where a write item's bytes are (``WriteResult.storage_data``, pickled into DCP's metadata): the rank
    artifact's id (immutable, so a moved key cannot change what a checkpoint reads) and the tensor's name."""

    artifact_id: str
    name: str


@dataclass(frozen=True, slots=True)
class CheckpointEntry:
    """One checkpoint of a run as listed: its key, when its manifest was committed, whether it is read now."""

    key: str
    created_at: float
    reading: bool


def rank_key(key: str, rank: int) -> str:
    return f"{key}{_RANK}{rank:05d}"


def reading_prefix(key: str) -> str:
    return key + _READING


def is_bundle_member(key: str) -> bool:
    """True for a rank artifact's or read mark's key, i.e. not a checkpoint's own (manifest) key."""
    return _RANK in key or _READING in key


def run_prefix(key: str) -> str:
    """The run a checkpoint belongs to: its key up to the last ``/`` (``run7/step-1200`` -> ``run7/``)."""
    return key.rsplit("/", 1)[0] + "/" if "/" in key else ""


def item_name(fqn: str, offset: Sequence[int] | None) -> str:
    """A write item's tensor name in its rank's artifact: the fully qualified name, plus the chunk's offset
    for shards (one rank may hold several chunks of one tensor)."""
    return chunk_name(fqn, offset)


def read_slices(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> list[tuple[int, slice]]:
    """The slices of a stored chunk of ``shape`` that a read item needs (DCP's ``storage_offsets``/``lengths``
    in the chunk's coordinates); whole dimensions are left out, so the holder sends only those bytes."""
    out = []
    for dim, (size, off, length) in enumerate(zip(shape, offsets, lengths, strict=True)):
        if off != 0 or length != size:
            out.append((dim, slice(int(off), int(off) + int(length))))
    return out


def read_rounds(names: Sequence[str]) -> list[list[int]]:
    """Indices of read items grouped so that no group names one stored tensor twice (a view takes one slice
    per tensor); items keep their order, a repeat starts the next group."""
    rounds: list[list[int]] = []
    seen: list[set[str]] = []
    for i, name in enumerate(names):
        for group, used in zip(rounds, seen, strict=True):
            if name not in used:
                group.append(i)
                used.add(name)
                break
        else:
            rounds.append([i])
            seen.append({name})
    return rounds


def memory_first(final: Placement) -> Placement | None:
    """The placement of a save's first put when ``final`` wants a disk copy: the same memory replicas
    without disk, so the training stall ends when memory holds them; the disk copy follows in the background
    (a second put of the same content under ``final``). None when ``final`` has no disk copy to defer."""
    if final.disk != "required":
        return None
    return msgspec.structs.replace(final, name=f"{final.name}-staged", disk="none",
                                   memory="preferred" if final.memory == "none" else final.memory,
                                   overflow="evict" if final.overflow == "spill" else final.overflow,
                                   memory_ttl=None)


def writer_worker(workers: Iterable[WorkerInfo], host_id: str, rank: int) -> str | None:
    """The worker rank ``rank`` writes its shards to: one on its own host (a same-host put, through shared
    memory), spread over that host's workers by rank. None when no live worker is on this host."""
    local = sorted(w.worker_id for w in workers if w.host_id == host_id and w.alive)
    return local[rank % len(local)] if local else None


def collectable(entries: Sequence[CheckpointEntry], keep_last: int) -> list[str]:
    """The checkpoints ``keep_last`` collects: all but the newest ``keep_last`` (by commit time, then key),
    except those being read now."""
    if keep_last < 1:
        return []
    ordered = sorted(entries, key=lambda e: (e.created_at, _natural(e.key)))
    return [e.key for e in ordered[:-keep_last] if not e.reading]


def _natural(key: str) -> tuple[tuple[int, int | str], ...]:
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", key) if p)
