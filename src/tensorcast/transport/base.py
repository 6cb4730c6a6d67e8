"""The transport interface: how bulk tensor bytes move, independent of the medium.

Owns: the small types every transport shares (``SourceLease`` on the sending side, ``FetchStats`` on the
receiving side, ``ChunkCorrupted``) and the ``Transport`` protocol. The TCP implementation is
``transport.tcp``; same-host hand-off is shared memory (``pool.segments``, no transport at all); CUDA IPC,
RDMA or UCX/NIXL transports implement the same ``fetch`` later.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import xxhash

from tensorcast.config import TransportConfig
from tensorcast.errors import Unavailable
from tensorcast.wire.messages import DataRequest

__all__ = ["CHUNK_BYTES", "ChunkCorrupted", "FetchStats", "SourceLease", "Transport", "chunk_checksums",
           "stream_count"]

# The chunk grid of the data plane: checksums are per chunk of this size, from offset 0 of a tensor.
CHUNK_BYTES = 4 * 1024 * 1024


def stream_count(config: TransportConfig, nbytes: int) -> int:
    """Streams for a transfer of ``nbytes`` (``transport.streams``, or automatic by size)."""
    if config.streams > 0:
        return min(config.streams, config.max_streams)
    return 1 if nbytes < config.auto_streams_min_bytes else config.max_streams


def chunk_checksums(view: memoryview) -> list[int]:
    return [xxhash.xxh3_64_intdigest(view[i : i + CHUNK_BYTES]) for i in range(0, len(view), CHUNK_BYTES)]


class ChunkCorrupted(Unavailable):
    """A received chunk failed its checksum; nothing from that range was kept. Retryable."""


@dataclass
class SourceLease:
    """Bytes a sender may read until ``release`` is called (the pool will not unmap or reuse them)."""

    view: memoryview
    tier: str
    release: Callable[[], None]
    # xxh3-64 of each CHUNK_BYTES-sized chunk of ``view`` if already known (saves the sender a pass).
    checksums: list[int] | None = None


@dataclass
class FetchStats:
    bytes: int = 0
    seconds: float = 0.0
    streams: int = 1
    tier: str = ""
    retries: int = 0


class Transport(Protocol):
    def fetch(
        self,
        address: str,
        request: DataRequest,
        dest: memoryview,
        *,
        streams: int = 1,
        deadline: float | None = None,
        trace_id: str = "",
    ) -> FetchStats: ...

    def close(self) -> None: ...
