"""Parallel reads of byte ranges of checkpoint files straight into destination memory.

Owns: reading a batch of ranges (the tensors, or one rank's slices, of a checkpoint) with a few threads
doing ``os.preadv`` into slices of the destinations (pre-faulted pool memory, so that the read does not
also pay first-touch faults). The batch is cut into chunks taken in file order by ``streams`` threads;
each file is opened once. Blocking; callers run it off the event loop. Does not own: which ranges to read,
or where the destination memory comes from.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tensorcast.errors import InvalidArgument, NotFound

__all__ = ["ReadJob", "read_ranges"]

_CHUNK = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ReadJob:
    """Read ``len(dest)`` bytes of ``path`` from ``offset`` into ``dest``; ``what`` names it in errors."""

    path: str
    offset: int
    dest: memoryview
    what: str = ""


def _read_chunk(fd: int, dest: memoryview, offset: int, job: ReadJob) -> None:
    pos = 0
    while pos < len(dest):
        n = os.preadv(fd, [dest[pos:]], offset + pos)
        if n == 0:
            what = f" (tensor {job.what!r})" if job.what else ""
            raise InvalidArgument(f"{job.path}: file ends before byte {job.offset + len(job.dest)}{what}: "
                                  f"truncated while reading")
        pos += n


def read_ranges(jobs: Sequence[ReadJob], *, streams: int = 4, chunk: int = _CHUNK) -> int:
    """Run a batch of reads with up to ``streams`` threads; returns the bytes read. The first error wins
    (the other reads stop early); the destinations are then partly written."""
    fds: dict[str, int] = {}
    try:
        pieces: list[tuple[int, memoryview, int, ReadJob]] = []
        for job in sorted(jobs, key=lambda j: (j.path, j.offset)):
            if job.path not in fds:
                try:
                    fds[job.path] = os.open(job.path, os.O_RDONLY)
                except FileNotFoundError:
                    raise NotFound(f"checkpoint file {job.path} is gone (tensor {job.what!r})") from None
            fd, size = fds[job.path], len(job.dest)
            if hasattr(os, "posix_fadvise") and size:
                os.posix_fadvise(fd, job.offset, size, os.POSIX_FADV_SEQUENTIAL)
            pieces += [(fd, job.dest[a : min(a + chunk, size)], job.offset + a, job) for a in range(0, size, chunk)]
        if len(pieces) <= 1 or streams <= 1:
            for fd, dest, offset, job in pieces:
                _read_chunk(fd, dest, offset, job)
        else:
            _run_parallel(pieces, streams)
        return sum(len(j.dest) for j in jobs)
    finally:
        for fd in fds.values():
            os.close(fd)


def _run_parallel(pieces: list[tuple[int, memoryview, int, ReadJob]], streams: int) -> None:
    """Each thread takes the next piece in file order until none is left or one failed."""
    lock = threading.Lock()
    cursor = iter(pieces)
    failed: list[BaseException] = []

    def stream() -> None:
        while True:
            with lock:
                if failed:
                    return
                piece = next(cursor, None)
            if piece is None:
                return
            try:
                _read_chunk(*piece)
            except BaseException as exc:
                with lock:
                    failed.append(exc)
                return

    with ThreadPoolExecutor(max_workers=min(streams, len(pieces)), thread_name_prefix="tensorcast-read") as ex:
        for f in [ex.submit(stream) for _ in range(min(streams, len(pieces)))]:
            f.result()
    if failed:
        raise failed[0]
