"""Parallel reads of checkpoint bytes (whole tensors, or one rank's slices) straight into destination memory.

Owns: running one batch of jobs with a few threads. A ``ReadJob`` is a byte range: ``os.preadv`` into a
slice of its destination (pre-faulted pool memory, so that the read does not also pay first-touch faults).
A ``SliceJob`` is a slice that is not one byte range (a row-parallel weight: half of every row; fused qkv:
a part of each of q, k, v). Slices on the first dimension only are a few contiguous runs, read like
ranges. The same columns of every row (a row-parallel weight) are read straight into place, a
``preadv`` per block of rows alternating destination and a discard buffer for the gaps. Others are read
a block of rows at a time into a per-thread scratch buffer and copied from there (numpy, through a plain
integer dtype). Every job is cut into pieces of about ``chunk`` bytes of
destination. All pieces share ``streams`` threads, in file order, so that reads and copies overlap and no
thread waits for another phase. Each file is opened once per batch, as a regular file only
(``weights.files.open_regular``).

Nothing is read through a mapping: a file truncated under a mapping kills the process with SIGBUS, while a
short ``pread`` is an error. A file whose size or mtime changed between the batch's open and its last read
is refused (``InvalidArgument``): its bytes may mix two versions.

A job whose path is an ``s3://`` URL reads from object storage instead (``weights.object_store``): pieces of
``weights.object_chunk_bytes`` as ranged GETs, ``weights.object_streams`` in flight, each pinned to the
object's ETag (a job's ``etag``). Object stores have no scatter reads: a slice across columns (a row-parallel
weight) reads its rows whole, a block at a time, and copies the columns out.

Blocking; callers run it off the event loop. Does not own: which bytes to read, or where the destination
memory comes from.
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
from tensorcast.records import SliceSpec
from tensorcast.tensors import raw_dtype
from tensorcast.views import apply_slices, sliced_shape
from tensorcast.weights.files import check_unchanged, identity, open_regular
from tensorcast.weights.object_store import ObjectURL, is_object_url, object_store

__all__ = ["ReadJob", "SliceJob", "read_ranges"]

_CHUNK = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ReadJob:
    """Read ``len(dest)`` bytes of ``path`` from ``offset`` into ``dest``; ``what`` names it in errors."""

    path: str
    offset: int
    dest: memoryview
    what: str = ""
    etag: str = ""  # an object's ETag at registration (s3:// paths): a read of another version is refused


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
    etag: str = ""

    @property
    def itemsize(self) -> int:
        return raw_dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.itemsize


Job = ReadJob | SliceJob
_Piece = tuple[str, int, Callable[[], None]]  # (file, offset: the order pieces run in, the work)


class _File:
    """A local checkpoint file, opened once per batch (regular files only) and checked unchanged at the end."""

    def __init__(self, job: Job) -> None:
        try:
            self.fd = open_regular(job.path)
        except NotFound:
            raise NotFound(f"checkpoint file {job.path} is gone (tensor {clip(job.what)})") from None
        self.path = job.path
        self.opened = identity(self.fd)

    def read(self, dest: memoryview, offset: int, job: Job) -> None:
        _read_chunk(self.fd, dest, offset, job)

    def check_end(self, job: Job, end: int) -> None:
        _check_size(self.fd, job, end)

    def advise(self, offset: int, size: int) -> None:
        if hasattr(os, "posix_fadvise") and size:
            os.posix_fadvise(self.fd, offset, size, os.POSIX_FADV_SEQUENTIAL)

    def finish(self) -> None:
        check_unchanged(self.fd, self.path, self.opened)

    def close(self) -> None:
        os.close(self.fd)


class _Object:
    """An object in an S3-compatible store: ranged GETs pinned to its ETag (each checks its own length)."""

    def __init__(self, job: Job) -> None:
        self.url = ObjectURL.parse(job.path)
        self.store = object_store()
        self.ranges: list[tuple[int, memoryview, Job]] = []  # byte ranges to read, merged by ``pieces``

    def read(self, dest: memoryview, offset: int, job: Job) -> None:
        self.store.read_into(self.url, offset, dest, job.etag, job.what)

    def pieces(self, chunk: int) -> list[_Piece]:
        """The byte ranges asked for, adjacent ones merged and cut into GETs of ``chunk`` bytes: a file's
        tensors lie back to back, and every request costs a first-byte latency (and a fee)."""
        out: list[_Piece] = []
        dests: list[memoryview] = []
        job: Job | None = None
        start, end = 0, -1
        for offset, dest, job_of in sorted(self.ranges, key=lambda r: r[0]):
            pos = 0
            while pos < len(dest):
                if offset + pos != end or end - start >= chunk:
                    if dests and job is not None:
                        out.append(self._piece(start, dests, job))
                    start = end = offset + pos
                    dests, job = [], job_of
                take = min(len(dest) - pos, chunk - (end - start))
                dests.append(dest[pos : pos + take])
                end += take
                pos += take
        if dests and job is not None:
            out.append(self._piece(start, dests, job))
        return out

    def _piece(self, offset: int, dests: list[memoryview], job: Job) -> _Piece:
        return job.path, offset, lambda: self.store.read_into(self.url, offset, dests, job.etag, job.what)

    def check_end(self, job: Job, end: int) -> None:
        return None

    def advise(self, offset: int, size: int) -> None:
        return None

    def finish(self) -> None:
        return None

    def close(self) -> None:
        return None


_Source = _File | _Object


def read_ranges(jobs: Sequence[Job], *, streams: int = 4, chunk: int = _CHUNK) -> int:
    """Run a batch of reads and slice copies with up to ``streams`` threads; returns the bytes written.
    The first error wins (the other pieces stop early); the destinations are then partly written."""
    sources: dict[str, _Source] = {}
    try:
        if any(is_object_url(j.path) for j in jobs):  # the object store's own sizes: many small GETs in flight
            settings = object_store().config
            streams, chunk = max(streams, settings.object_streams), settings.object_chunk_bytes
        pieces: list[_Piece] = []
        for job in jobs:
            if job.path not in sources:
                sources[job.path] = _Object(job) if is_object_url(job.path) else _File(job)
            src = sources[job.path]
            if isinstance(job, ReadJob):
                pieces += _read_pieces(src, job.offset, job.dest, job, chunk)
                continue
            src.check_end(job, job.offset + job.nbytes)
            runs = _contiguous_runs(job)
            if runs is not None:
                pos = 0
                for start, length in runs:
                    pieces += _read_pieces(src, job.offset + start, job.dest[pos : pos + length], job, chunk)
                    pos += length
            elif isinstance(src, _File) and (gather := _row_runs(job)) is not None:
                pieces += _gather_pieces(src.fd, job, *gather, chunk)
            else:
                pieces += _copy_pieces(src, job, chunk)
        pieces += [p for src in sources.values() if isinstance(src, _Object) for p in src.pieces(chunk)]
        pieces.sort(key=lambda p: (p[0], p[1]))
        if len(pieces) <= 1 or streams <= 1:
            for _, _, run in pieces:
                run()
        else:
            _run_parallel([run for _, _, run in pieces], streams)
        for src in sources.values():
            src.finish()
        return sum(len(j.dest) for j in jobs)
    finally:
        for src in sources.values():
            src.close()


def _check_size(fd: int, job: Job, end: int) -> None:
    if os.fstat(fd).st_size < end:
        what = f" (tensor {job.what!r})" if job.what else ""
        raise InvalidArgument(f"{job.path}: file ends before byte {end}{what}: truncated while reading")


def _read_pieces(src: _Source, offset: int, dest: memoryview, job: Job, chunk: int) -> list[_Piece]:
    if isinstance(src, _Object):  # merged with its neighbours into GETs at the end (``_Object.pieces``)
        src.ranges.append((offset, dest, job))
        return []
    size = len(dest)
    src.advise(offset, size)

    def read(piece: memoryview, at: int) -> Callable[[], None]:
        return lambda: src.read(piece, at, job)

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


def _row_runs(job: SliceJob) -> tuple[int, int, int, int] | None:
    """(rows, bytes per row, offset and length of the run taken from each row) when the slice is one unit-step
    range of one dimension past the first (a row-parallel weight: the same columns of every row), else None."""
    if len(job.specs) != 1 or job.specs[0].dim == 0 or job.specs[0].ranges or job.specs[0].step != 1:
        return None
    spec = job.specs[0]
    inner = int(np.prod(job.shape[spec.dim + 1 :], dtype=np.int64)) * job.itemsize
    rows = int(np.prod(job.shape[: spec.dim], dtype=np.int64))
    taken = sliced_shape(job.shape, job.specs)[spec.dim]
    return rows, job.shape[spec.dim] * inner, min(spec.start, job.shape[spec.dim]) * inner, taken * inner


_MAX_GAP = 256 * 1024  # bytes between two rows' runs read into a discard buffer rather than skipped by a call
_discard = bytearray(_MAX_GAP)  # written by the kernel, never read: threads may share it
_IOV_ROWS = 500  # rows per preadv: two buffers each, under IOV_MAX (1024)


def _gather_pieces(fd: int, job: SliceJob, rows: int, row: int, at: int, run: int, chunk: int) -> list[_Piece]:
    """Each row's run read straight into its place in ``dest``: one ``preadv`` per block of rows, whose
    iovecs alternate the destination and a small discard buffer for the gap (no copy, no mapping)."""
    if run == 0 or rows == 0:
        return []
    per_block = max(1, chunk // run)
    gap = row - run

    def block(first: int, n: int) -> Callable[[], None]:
        def read() -> None:
            if gap > _MAX_GAP:
                for r in range(first, first + n):
                    _read_chunk(fd, job.dest[r * run : (r + 1) * run], job.offset + r * row + at, job)
                return
            skip = memoryview(_discard)[:gap]
            for lo in range(first, first + n, _IOV_ROWS):
                hi = min(lo + _IOV_ROWS, first + n)
                iov = [x for r in range(lo, hi) for x in (job.dest[r * run : (r + 1) * run], skip)][:-1]
                want = (hi - lo) * row - gap
                if os.preadv(fd, iov, job.offset + lo * row + at) < want:  # the file ended: say where
                    for r in range(lo, hi):
                        _read_chunk(fd, job.dest[r * run : (r + 1) * run], job.offset + r * row + at, job)

        return read

    return [(job.path, job.offset + i * row + at, block(i, min(per_block, rows - i)))
            for i in range(0, rows, per_block)]


def _copy_pieces(src: _Source, job: SliceJob, chunk: int) -> list[_Piece]:
    """Blocks of whole output rows (first dimension), each read on its own and copied from the scratch."""
    dtype = raw_dtype(job.dtype)  # bytes are bytes: numpy's memcpy paths, whatever the element type
    first = next((s for s in job.specs if s.dim == 0), None)
    inner = tuple(s for s in job.specs if s.dim != 0)
    out_shape = sliced_shape(job.shape, job.specs)
    out_row = int(np.prod(out_shape[1:], dtype=np.int64)) * job.itemsize
    src_row = int(np.prod(job.shape[1:], dtype=np.int64)) * job.itemsize
    pieces: list[_Piece] = []
    out_at = 0
    for start, stop, step in _dim0_ranges(first, job.shape[0]):
        rows = len(range(start, stop, step))
        per_block = max(1, min(chunk // max(1, out_row), chunk // max(1, step * src_row)))  # scratch <= chunk
        for i in range(0, rows, per_block):
            n = min(per_block, rows - i)
            lo = start + i * step
            span = (job.offset + lo * src_row, (n - 1) * step * src_row + src_row)  # bytes spanned in the file
            dst = (out_at + i * out_row, n * out_row)
            pieces.append((job.path, span[0], _copier(src, job, dtype, inner, step, span, dst, (n, *out_shape[1:]))))
        out_at += rows * out_row
    return pieces


_scratch = threading.local()


def _scratch_view(size: int) -> memoryview:
    """This thread's scratch buffer, at least ``size`` bytes (kept for the batch: fresh pages cost a fault each)."""
    buf: bytearray | None = getattr(_scratch, "buf", None)
    if buf is None or len(buf) < size:
        buf = _scratch.buf = bytearray(size)
    return memoryview(buf)[:size]


def _copier(src: _Source, job: SliceJob, dtype: np.dtype[Any], inner: tuple[SliceSpec, ...], step: int,
            span: tuple[int, int], dst: tuple[int, int], out_shape: tuple[int, ...]) -> Callable[[], None]:
    def copy() -> None:
        scratch = _scratch_view(span[1])
        src.read(scratch, span[0], job)
        rows = np.frombuffer(scratch, np.uint8).view(dtype).reshape(-1, *job.shape[1:])[::step]
        out = np.frombuffer(job.dest[dst[0] : dst[0] + dst[1]], np.uint8).view(dtype).reshape(out_shape)
        np.copyto(out, apply_slices(rows, inner))

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
