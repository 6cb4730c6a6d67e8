"""Parallel reads of checkpoint bytes (whole tensors, or one rank's slices) straight into destination memory.

Owns: running one batch of jobs with a few threads. A ``ReadJob`` is a byte range: ``os.preadv`` into a
slice of its destination (pre-faulted pool memory, so that the read does not also pay first-touch faults).
A ``SliceJob`` is a slice that is not one byte range (a row-parallel weight: half of every row; fused qkv:
a part of each of q, k, v). Slices on the first dimension only are a few contiguous runs, read like
ranges. Others are copied out of a read-only mapping of the file: its pages are populated in one call per
block of rows (a fault per 4 KiB page would cost more than the copy), then numpy copies through a plain
integer dtype. Every job is cut into pieces of about ``chunk`` bytes of destination. All pieces share
``streams`` threads, in file order, so that reads and copies overlap and no thread waits for another
phase. Each file is opened (and, for copies, mapped) once per batch.

Blocking; callers run it off the event loop. Does not own: which bytes to read, or where the destination
memory comes from. A file truncated *while* it is being copied from raises SIGBUS, as with any mapping;
sizes are checked before (the worker also checks size and mtime against the registration).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorcast.errors import InvalidArgument, NotFound, clip
from tensorcast.pool.segments import Segment
from tensorcast.records import SliceSpec
from tensorcast.tensors import raw_dtype
from tensorcast.views import apply_slices, sliced_shape

__all__ = ["ReadJob", "SliceJob", "read_ranges"]

_CHUNK = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ReadJob:
    """Read ``len(dest)`` bytes of ``path`` from ``offset`` into ``dest``; ``what`` names it in errors."""

    path: str
    offset: int
    dest: memoryview
    what: str = ""


@dataclass(frozen=True, slots=True)
class SliceJob:
    """Copy ``specs`` of the row-major tensor of ``dtype`` (a TensorCast dtype name) and ``shape`` stored
    at ``offset`` in ``path`` into ``dest``, contiguous, in the sliced shape."""

    path: str
    offset: int
    dtype: str
    shape: tuple[int, ...]
    specs: tuple[SliceSpec, ...]
    dest: memoryview
    what: str = ""

    @property
    def itemsize(self) -> int:
        return raw_dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.itemsize


Job = ReadJob | SliceJob
_Piece = tuple[str, int, Callable[[], None]]  # (file, offset: the order pieces run in, the work)


def read_ranges(jobs: Sequence[Job], *, streams: int = 4, chunk: int = _CHUNK) -> int:
    """Run a batch of reads and slice copies with up to ``streams`` threads; returns the bytes written.
    The first error wins (the other pieces stop early); the destinations are then partly written."""
    fds: dict[str, int] = {}
    maps: dict[str, Segment] = {}  # files copied from, mapped read-only
    try:
        pieces: list[_Piece] = []
        for job in jobs:
            if job.path not in fds:
                try:
                    fds[job.path] = os.open(job.path, os.O_RDONLY)
                except FileNotFoundError:
                    raise NotFound(f"checkpoint file {job.path} is gone (tensor {clip(job.what)})") from None
            fd = fds[job.path]
            if isinstance(job, ReadJob):
                pieces += _read_pieces(fd, job.offset, job.dest, job, chunk)
                continue
            _check_size(fd, job, job.offset + job.nbytes)
            runs = _contiguous_runs(job)
            if runs is not None:
                pos = 0
                for start, length in runs:
                    pieces += _read_pieces(fd, job.offset + start, job.dest[pos : pos + length], job, chunk)
                    pos += length
            else:
                if job.path not in maps:
                    maps[job.path] = Segment.open_existing(job.path)
                pieces += _copy_pieces(maps[job.path], job, chunk)
        pieces.sort(key=lambda p: (p[0], p[1]))
        if len(pieces) <= 1 or streams <= 1:
            for _, _, run in pieces:
                run()
        else:
            _run_parallel([run for _, _, run in pieces], streams)
        return sum(len(j.dest) for j in jobs)
    finally:
        for seg in maps.values():
            seg.try_close()  # a piece that failed may still hold a view: then GC unmaps it
        for fd in fds.values():
            os.close(fd)


def _check_size(fd: int, job: Job, end: int) -> None:
    if os.fstat(fd).st_size < end:
        what = f" (tensor {job.what!r})" if job.what else ""
        raise InvalidArgument(f"{job.path}: file ends before byte {end}{what}: truncated while reading")


def _read_pieces(fd: int, offset: int, dest: memoryview, job: Job, chunk: int) -> list[_Piece]:
    size = len(dest)
    if hasattr(os, "posix_fadvise") and size:
        os.posix_fadvise(fd, offset, size, os.POSIX_FADV_SEQUENTIAL)

    def read(piece: memoryview, at: int) -> Callable[[], None]:
        return lambda: _read_chunk(fd, piece, at, job)

    return [(job.path, offset + a, read(dest[a : min(a + chunk, size)], offset + a)) for a in range(0, size, chunk)]


def _read_chunk(fd: int, dest: memoryview, offset: int, job: Job) -> None:
    pos = 0
    while pos < len(dest):
        n = os.preadv(fd, [dest[pos:]], offset + pos)
        if n == 0:
            _check_size(fd, job, offset + len(dest))
            raise InvalidArgument(f"{job.path}: short read at byte {offset + pos} (tensor {clip(job.what)})")
        pos += n


def _dim0_ranges(spec: SliceSpec | None, n: int) -> list[tuple[int, int, int]]:
    """The first dimension's selection as (start, stop, step) runs, in order."""
    if spec is None:
        return [(0, n, 1)]
    if spec.ranges:
        return [(a, b, 1) for a, b in spec.ranges if b > a]
    return [(spec.start, spec.stop, spec.step)] if spec.stop > spec.start else []


def _contiguous_runs(job: SliceJob) -> list[tuple[int, int]] | None:
    """(byte offset in the tensor, length) of each contiguous run the slice is made of, when it slices the
    first dimension only with unit steps (fused qkv: one run per part); else None."""
    if not job.shape or any(s.dim != 0 for s in job.specs):
        return None
    spec = job.specs[0] if job.specs else None
    runs = _dim0_ranges(spec, job.shape[0])
    if any(step != 1 for _, _, step in runs):
        return None
    row = int(np.prod(job.shape[1:], dtype=np.int64)) * job.itemsize
    return [(a * row, (b - a) * row) for a, b, _ in runs]


def _copy_pieces(mapped: Segment, job: SliceJob, chunk: int) -> list[_Piece]:
    """Blocks of whole output rows (first dimension), each copied on its own from the mapping."""
    dtype = raw_dtype(job.dtype)  # bytes are bytes: numpy's memcpy paths, whatever the element type
    first = next((s for s in job.specs if s.dim == 0), None)
    inner = tuple(s for s in job.specs if s.dim != 0)
    out_shape = sliced_shape(job.shape, job.specs)
    out_row = int(np.prod(out_shape[1:], dtype=np.int64)) * job.itemsize
    src_row = int(np.prod(job.shape[1:], dtype=np.int64)) * job.itemsize
    per_block = max(1, chunk // max(1, out_row))
    pieces: list[_Piece] = []
    out_at = 0
    for start, stop, step in _dim0_ranges(first, job.shape[0]):
        rows = len(range(start, stop, step))
        for i in range(0, rows, per_block):
            n = min(per_block, rows - i)
            lo = start + i * step
            src = (job.offset + lo * src_row, (n - 1) * step * src_row + src_row)  # bytes spanned in the file
            dst = (out_at + i * out_row, n * out_row)
            rows_read = slice(lo, lo + (n - 1) * step + 1, step)
            pieces.append((job.path, src[0], _copier(mapped, job, dtype, inner, rows_read, src, dst,
                                                     (n, *out_shape[1:]))))
        out_at += rows * out_row
    return pieces


def _copier(mapped: Segment, job: SliceJob, dtype: np.dtype[Any], inner: tuple[SliceSpec, ...], rows: slice,
            src: tuple[int, int], dst: tuple[int, int], out_shape: tuple[int, ...]) -> Callable[[], None]:
    def copy() -> None:
        mapped.populate(*src)
        arr = np.frombuffer(mapped.view(), np.uint8, count=job.nbytes, offset=job.offset).view(dtype).reshape(job.shape)
        part = apply_slices(arr[rows], inner)
        out = np.frombuffer(job.dest[dst[0] : dst[0] + dst[1]], np.uint8).view(dtype).reshape(out_shape)
        np.copyto(out, part)

    return copy


def _run_parallel(pieces: list[Callable[[], None]], streams: int) -> None:
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
                piece()
            except BaseException as exc:
                with lock:
                    failed.append(exc)
                return

    with ThreadPoolExecutor(max_workers=min(streams, len(pieces)), thread_name_prefix="tensorcast-read") as ex:
        for f in [ex.submit(stream) for _ in range(min(streams, len(pieces)))]:
            f.result()
    if failed:
        raise failed[0]
