"""The transport interface: how bulk tensor bytes move, independent of the medium.

Owns: the ``Transport`` protocol callers hold (``fetch`` a byte range of a remote tensor into a buffer;
``serve`` a worker's bytes), the ``DataServer`` a worker runs, and the small types every transport
shares (``SourceLease`` on the sending side, ``FetchStats`` on the receiving side, the stream split).
Every implementation checks each chunk against the sender's xxh3 checksum (``tensorcast.checksums``) and
raises ``ChunkCorrupted`` rather than keep a bad byte. Implementations: ``transport.tcp`` (parallel TCP
streams, the default) and ``transport.inproc`` (one process, for unit tests); ``transport.registry``
picks one by ``transport.kind``. A same-host hand-off needs no transport (shared memory, ``pool``).
RDMA or UCX/NIXL transports implement the same two calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from tensorcast.checksums import CHUNK_BYTES, ChunkCorrupted, chunk_checksums
from tensorcast.config import TransportConfig
from tensorcast.wire.messages import DataRequest

__all__ = ["CHUNK_BYTES", "ChunkCorrupted", "DataServer", "FetchStats", "SourceLease", "SourceOpener", "Transport",
           "chunk_checksums", "split_ranges", "stream_count"]


def stream_count(config: TransportConfig, nbytes: int) -> int:
    """Streams for a transfer of ``nbytes`` (``transport.streams``, or automatic by size)."""
    if config.streams > 0:
        return min(config.streams, config.max_streams)
    return 1 if nbytes < config.auto_streams_min_bytes else config.max_streams


def split_ranges(total: int, streams: int, sliced: bool) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges of a ``total``-byte transfer, one per stream, aligned to the chunk grid (so that
    a sender's cached checksums apply). A strided slice is cut by the sender in one piece: one stream."""
    streams = max(1, min(streams, total // CHUNK_BYTES or 1)) if not sliced else 1
    per = -(-total // streams)
    per = -(-per // CHUNK_BYTES) * CHUNK_BYTES
    return [(s, min(s + per, total)) for s in range(0, total, per)] or [(0, 0)]


@dataclass
class SourceLease:
    """Bytes a sender may read until ``release`` is called (the pool will not unmap or reuse them)."""

    view: memoryview
    tier: str
    release: Callable[[], None]
    # xxh3-64 of each CHUNK_BYTES-sized chunk of ``view`` if already known (saves the sender a pass).
    checksums: list[int] | None = None
    # Where not known: ``learn(first_chunk, sums)`` takes those a sender computed for whole chunks of the grid
    # as it sent them (chunk ``first_chunk`` on), so that later sends need no hashing pass.
    learn: Callable[[int, list[int]], None] | None = None
    # Called with the range's byte count once all of it has been sent (not when a send breaks off): the
    # owner of the bytes counts what it served without the transport knowing how.
    sent: Callable[[int], None] | None = None


# Resolves a request to the bytes it names (the worker's store), on the transport's threads.
SourceOpener = Callable[[DataRequest], SourceLease]


@dataclass
class FetchStats:
    bytes: int = 0
    seconds: float = 0.0
    streams: int = 1
    tier: str = ""
    retries: int = 0


class DataServer(Protocol):
    """A worker's side of a transport: serves ``DataRequest``s from its ``SourceOpener``."""

    address: str

    @property
    def bytes_sent(self) -> int:
        """Payload bytes sent so far (the network-pressure signal)."""

    @property
    def active(self) -> int:
        """Ranges being sent right now."""

    def start(self, host: str, port: int) -> str: ...

    def close(self) -> None: ...

    def healthy(self) -> bool:
        """Whether it still serves (its loop runs): reported by ``/healthz`` and the heartbeat."""


class Transport(Protocol):
    kind: str

    def fetch(self, address: str, request: DataRequest, dest: memoryview, *, streams: int = 1,
              deadline: float | None = None, trace_id: str = "", checksums: list[int] | None = None) -> FetchStats:
        """Fill ``dest`` with ``len(dest)`` bytes of the requested tensor from ``request.offset`` (after its
        ``slices``). Blocking. If ``checksums`` is a list it receives the verified chunk checksums."""

    def serve(self, open_source: SourceOpener, *, corrupt_chunks: int = 0) -> DataServer:
        """A data server for this transport (``corrupt_chunks``: fault injection for tests)."""

    def close(self) -> None: ...
