"""Data plane: bulk tensor bytes between workers and callers (TCP streams today; room for CUDA IPC/RDMA)."""

from tensorcast.transport.base import ChunkCorrupted, FetchStats, SourceLease, Transport
from tensorcast.transport.tcp import DataServer, TcpTransport

__all__ = ["ChunkCorrupted", "DataServer", "FetchStats", "SourceLease", "TcpTransport", "Transport"]
