"""Sparse deltas between weight versions: which chunks of which tensors changed (pure but for hashing).

Owns how a tensor is cut into chunks (runs of whole rows along its first dimension, about ``chunk_bytes``
each, so that a chunk is one contiguous byte range any reader can ask for as a view slice: mapped on the same
host, one ranged fetch from another), each chunk's XXH3-128, the comparison of two publishes' chunk tables, and
the delta record a publisher stores inside a version (tensor ``weights.versions.DELTA_TENSOR``, JSON as uint8):
the version it is a delta from and, per tensor that changed, its changed chunks with their checksums. A reader
that holds the base version reads those chunks only, and checks each against its checksum.

Why rows: a flat byte range inside a row is not something vLLM's loaders or a view can address; a run of rows
is, at any tensor-parallel split along either dimension (the loader maps checkpoint coordinates). A tensor of
one huge row is one chunk. Why XXH3-128 rather than the pool's BLAKE3: it runs at memory speed on one core (the
publisher's one pass over the bytes), and it guards against torn or misplaced bytes, not against the publisher.
Does not own: publishing (``client.publisher``), reading a delta (``integrations.rollout_delta``) or applying
one (``integrations.vllm_transfer``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from tensorcast.errors import InvalidArgument, clip
from tensorcast.weights.versions import META_TENSORS, check_version

__all__ = ["DIGEST_BYTES", "MAX_DELTA_FRACTION", "Chunking", "Delta", "TensorChunks", "changed_chunks",
           "chunk_digests", "chunking", "delta_between", "runs"]

DIGEST_BYTES = 16  # XXH3-128
# Above this fraction of a version's bytes changed, a publish records no delta: reading everything is as cheap,
# and the record would grow with the model.
MAX_DELTA_FRACTION = 0.5


@dataclass(frozen=True)
class Chunking:
    """How one tensor is cut: ``rows`` rows (its first dimension; a scalar is one row) of ``row_bytes`` each,
    ``per_chunk`` rows to a chunk (the last may be shorter)."""

    rows: int
    row_bytes: int
    per_chunk: int

    @property
    def count(self) -> int:
        return -(-self.rows // self.per_chunk)

    def rows_of(self, first: int, end: int) -> tuple[int, int]:
        """The rows of chunks ``first`` to ``end - 1``."""
        return first * self.per_chunk, min(end * self.per_chunk, self.rows)

    def nbytes(self, first: int, end: int) -> int:
        r0, r1 = self.rows_of(first, end)
        return (r1 - r0) * self.row_bytes


def _rows(shape: Sequence[int], nbytes: int) -> tuple[int, int]:
    """A tensor's rows (its first dimension; a scalar is one row) and the bytes of each."""
    rows = int(shape[0]) if shape else 1
    return rows, nbytes // rows if rows else 0


def chunking(shape: Sequence[int], nbytes: int, chunk_bytes: int) -> Chunking:
    if chunk_bytes < 1:
        raise InvalidArgument(f"chunk_bytes must be >= 1, got {clip(chunk_bytes)}")
    rows, row_bytes = _rows(shape, nbytes)
    return Chunking(rows, row_bytes, max(1, chunk_bytes // row_bytes) if row_bytes else max(1, rows))


# What a publisher keeps of each tensor it published: (dtype, shape, its chunking, its chunk digests).
TensorChunks = tuple[str, tuple[int, ...], Chunking, bytes]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def with_rows(shape: Sequence[int], nbytes: int, per_chunk: int) -> Chunking:
    """The chunking of a tensor with ``per_chunk`` rows to a chunk (as a delta record states it)."""
    return Chunking(*_rows(shape, nbytes), per_chunk)


def chunk_digests(data: np.ndarray[Any, np.dtype[np.uint8]], cut: Chunking) -> bytes:
    """Each chunk's XXH3-128, concatenated (``DIGEST_BYTES`` each), of a tensor's bytes (flat uint8)."""
    step = cut.per_chunk * cut.row_bytes
    mv = np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
    return b"".join(xxhash.xxh3_128_digest(mv[i * step:(i + 1) * step]) for i in range(cut.count))


def changed_chunks(before: bytes, after: bytes) -> list[int]:
    """The indices of the chunks whose digests differ (equal-length tables)."""
    if len(before) != len(after):
        raise InvalidArgument("chunk tables of different lengths: not the same tensor layout")
    return [i for i in range(len(after) // DIGEST_BYTES)
            if before[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES] != after[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES]]


def runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted indices merged into ``(first, end)`` runs of consecutive ones."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


@dataclass(frozen=True)
class Delta:
    """A version's delta from ``base``: per changed tensor, rows per chunk and ``((chunk, xxh3 hex), ...)``."""

    base: int
    tensors: Mapping[str, tuple[int, tuple[tuple[int, str], ...]]]

    def encode(self) -> np.ndarray[Any, np.dtype[np.uint8]]:
        doc = {"base": self.base, "tensors": {n: {"rows": rows, "chunks": [list(c) for c in chunks]}
                                              for n, (rows, chunks) in sorted(self.tensors.items())}}
        return np.frombuffer(json.dumps(doc, separators=(",", ":")).encode(), dtype=np.uint8).copy()

    @classmethod
    def decode(cls, raw: Any, layout: Mapping[str, tuple[tuple[int, ...], int]]) -> Delta:
        """The record in ``raw`` (uint8 bytes), checked against the version's ``{name: (shape, nbytes)}``:
        ``InvalidArgument`` for anything malformed (a reader then loads the whole version)."""
        try:
            doc = json.loads(np.asarray(raw).tobytes())
            base = check_version(doc["base"], "a delta's base")
            tensors: dict[str, tuple[int, tuple[tuple[int, str], ...]]] = {}
            for name, entry in doc["tensors"].items():
                if name in META_TENSORS:
                    raise ValueError(f"{name!r} is not a weight")
                shape, nbytes = layout[name]
                per_chunk = entry["rows"]
                if not _is_int(per_chunk) or per_chunk < 1:
                    raise ValueError(f"tensor {name!r}: rows per chunk {per_chunk!r}")
                cut = with_rows(shape, nbytes, per_chunk)
                chunks = tuple((i, h) for i, h in entry["chunks"])
                if not chunks or any(not _is_int(i) or not isinstance(h, str) for i, h in chunks):
                    raise ValueError(f"tensor {name!r}: chunks are [index, hex digest] pairs")
                if any(not 0 <= i < cut.count or len(bytes.fromhex(h)) != DIGEST_BYTES for i, h in chunks) or \
                        [i for i, _ in chunks] != sorted({i for i, _ in chunks}):
                    raise ValueError(f"tensor {name!r}: chunks out of range, unsorted or repeated")
                tensors[name] = (per_chunk, chunks)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError, InvalidArgument) as exc:
            raise InvalidArgument(f"malformed delta record: {clip(str(exc))}") from exc
        return cls(base, tensors)

    def nbytes(self, layout: Mapping[str, tuple[tuple[int, ...], int]]) -> int:
        """The bytes of the changed chunks: what a reader holding ``base`` reads."""
        total = 0
        for name, (per_chunk, chunks) in self.tensors.items():
            cut = with_rows(*layout[name], per_chunk)
            total += sum(cut.nbytes(i, i + 1) for i, _ in chunks)
        return total


def delta_between(base: int, before: Mapping[str, TensorChunks], after: Mapping[str, TensorChunks]) -> Delta | None:
    """The delta from ``base`` given each tensor's chunks at the base and now; None when the tensors' names,
    dtypes, shapes or chunking differ (no delta applies) or more than ``MAX_DELTA_FRACTION`` of the bytes
    changed."""
    if before.keys() != after.keys() or any(before[n][:3] != after[n][:3] for n in after):
        return None
    tensors: dict[str, tuple[int, tuple[tuple[int, str], ...]]] = {}
    changed_bytes = total = 0
    for name, (_dtype, _shape, cut, digests) in after.items():
        total += cut.nbytes(0, cut.count)
        changed = changed_chunks(before[name][3], digests)
        if changed:
            tensors[name] = (cut.per_chunk, tuple(
                (i, digests[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES].hex()) for i in changed))
            changed_bytes += sum(cut.nbytes(i, i + 1) for i in changed)
    return None if changed_bytes > MAX_DELTA_FRACTION * total else Delta(base, tensors)
