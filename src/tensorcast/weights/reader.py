"""Parallel reads of byte ranges of checkpoint files straight into destination memory.

Owns: splitting a range into chunks read by several threads with ``os.preadv`` into slices of the
destination (a pre-faulted pool segment, so the read does not also pay first-touch faults), with a
sequential-access hint. Blocking; callers run it off the event loop. Does not own: which ranges to read.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from tensorcast.errors import InvalidArgument

__all__ = ["pread_into"]

_CHUNK = 16 * 1024 * 1024


def _read_chunk(fd: int, dest: memoryview, offset: int, path: str) -> None:
    pos = 0
    while pos < len(dest):
        n = os.preadv(fd, [dest[pos:]], offset + pos)
        if n == 0:
            raise InvalidArgument(f"{path}: file ends before byte {offset + len(dest)} (truncated while reading)")
        pos += n


def pread_into(path: str, offset: int, dest: memoryview, *, streams: int = 4, chunk: int = _CHUNK,
               pool: ThreadPoolExecutor | None = None) -> None:
    """Read ``len(dest)`` bytes of ``path`` from ``offset`` into ``dest`` with up to ``streams`` readers."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset, len(dest), os.POSIX_FADV_SEQUENTIAL)
        pieces = [(a, min(a + chunk, len(dest))) for a in range(0, len(dest), chunk)]
        if len(pieces) <= 1 or streams <= 1:
            for a, b in pieces:
                _read_chunk(fd, dest[a:b], offset + a, path)
            return
        own = pool is None
        executor = pool or ThreadPoolExecutor(max_workers=streams, thread_name_prefix="tensorcast-read")
        try:
            futures = [executor.submit(_read_chunk, fd, dest[a:b], offset + a, path) for a, b in pieces]
            for f in futures:
                f.result()
        finally:
            if own:
                executor.shutdown()
    finally:
        os.close(fd)
