"""Data plane: bulk tensor bytes between workers and callers, behind the ``Transport`` interface.

Implementations: TCP streams (``transport.tcp``, the default) and in-process (``transport.inproc``, for unit
tests); ``make_transport`` chooses by ``transport.kind``. Also the host-to-device copy path (``h2d``) and
CUDA IPC handles (``cuda_ipc``).
"""

from tensorcast.checksums import ChunkCorrupted
from tensorcast.transport.base import DataServer, FetchStats, SourceLease, Transport
from tensorcast.transport.registry import make_transport

__all__ = ["ChunkCorrupted", "DataServer", "FetchStats", "SourceLease", "Transport", "make_transport"]
