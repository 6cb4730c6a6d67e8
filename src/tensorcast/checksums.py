"""The one checksum scheme of every bulk-byte path: xxh3-64 per chunk of a fixed grid.

Owns: the chunk grid (``CHUNK_BYTES`` from byte 0 of a tensor or payload) and computing and checking
the checksums, over one buffer or over several filled in order (a scatter list of KV pages counts as
one stream of bytes). The data plane (``transport``) sends each chunk's checksum before it; RPC payloads
(``wire``) send the list before the payload. A receiver that finds a mismatch keeps nothing of that
transfer and reports ``ChunkCorrupted`` (retryable). Pure; no I/O.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

from tensorcast.errors import ChunkCorrupted

__all__ = ["CHUNK_BYTES", "ChunkCorrupted", "chunk_checksums", "chunk_count", "first_bad_chunk", "pack_checksums",
           "unpack_checksums"]

# The chunk grid: checksums are per chunk of this size, from offset 0.
CHUNK_BYTES = 4 * 1024 * 1024
_PACK = struct.Struct("<Q")


def chunk_count(nbytes: int) -> int:
    return -(-nbytes // CHUNK_BYTES)


def chunk_checksums(views: memoryview | Sequence[memoryview]) -> list[int]:
    """xxh3-64 of each ``CHUNK_BYTES`` chunk of the bytes of ``views`` taken back to back."""
    if isinstance(views, memoryview):
        if views.nbytes <= CHUNK_BYTES or views.ndim != 1 or views.format not in ("B", "b", "c"):
            views = [views]
        else:
            return [xxhash.xxh3_64_intdigest(views[i : i + CHUNK_BYTES]) for i in range(0, len(views), CHUNK_BYTES)]
    out: list[int] = []
    h = xxhash.xxh3_64()
    filled = 0
    for view in views:
        raw = view if view.format == "B" and view.ndim == 1 else view.cast("B")
        pos = 0
        while pos < raw.nbytes:
            take = min(CHUNK_BYTES - filled, raw.nbytes - pos)
            h.update(raw[pos : pos + take])
            pos += take
            filled += take
            if filled == CHUNK_BYTES:
                out.append(h.intdigest())
                h.reset()
                filled = 0
    if filled:
        out.append(h.intdigest())
    return out


def first_bad_chunk(views: memoryview | Sequence[memoryview], expected: Sequence[int]) -> int | None:
    """The index of the first chunk whose checksum differs from ``expected`` (or a count mismatch), else None."""
    got = chunk_checksums(views)
    if len(got) != len(expected):
        return min(len(got), len(expected))
    return next((i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b), None)


def pack_checksums(sums: Sequence[int]) -> bytes:
    return b"".join(_PACK.pack(s) for s in sums)


def unpack_checksums(data: bytes | memoryview) -> list[int]:
    return [v for (v,) in _PACK.iter_unpack(data)]
