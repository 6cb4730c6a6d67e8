"""The bytes of checkpoints registered in place, as the store hands them out: read, never mapped.

Owns: reading a tensor (or only the range or slice a data request names) out of its checkpoint file into
memory of its own. A registered file truncated under a mapping would kill the worker with SIGBUS; a
``pread`` past its end is an error, and ``weights.reader`` refuses a file that changed while it was read.
Does not own: where a tensor lies (``worker.store``'s registrations) or checking them against the files.
"""

from __future__ import annotations

import math

import numpy as np

from tensorcast.records import TensorMeta
from tensorcast.tensors import raw_dtype
from tensorcast.transport.base import SourceLease
from tensorcast.views import sliced_shape
from tensorcast.weights.reader import ReadJob, SliceJob, read_ranges
from tensorcast.weights.safetensors import CheckpointTensor
from tensorcast.wire.messages import DataRequest

__all__ = ["in_place_source", "read_in_place"]


def read_in_place(loc: CheckpointTensor, meta: TensorMeta, offset: int, length: int) -> memoryview:
    """The tensor's bytes with only ``[offset, offset + length)`` read (np.empty: the rest stays unbacked)."""
    buf = np.empty(loc.nbytes, np.uint8)
    if length > 0:
        read_ranges([ReadJob(loc.file, loc.offset + offset, buf.data[offset : offset + length], meta.name,
                             loc.etag)], streams=1)
    return buf.data


def in_place_source(loc: CheckpointTensor, meta: TensorMeta, req: DataRequest) -> SourceLease:
    """A data request's bytes from a checkpoint file: only its slice, or only its range, read."""
    if req.slices:
        # sliced_shape checks the slices (a typed error) before anything is allocated or read.
        out = np.empty(math.prod(sliced_shape(meta.shape, req.slices)) * raw_dtype(meta.dtype).itemsize, np.uint8)
        read_ranges([SliceJob(loc.file, loc.offset, meta.dtype, meta.shape, tuple(req.slices), out.data,
                              meta.name, loc.etag)], streams=1)
        return SourceLease(out.data, "disk", lambda: None)
    length = loc.nbytes - req.offset if req.length < 0 else req.length
    inside = req.offset >= 0 and length >= 0 and req.offset + length <= loc.nbytes
    # A range outside the tensor is the sender's to refuse; nothing is read for it.
    return SourceLease(read_in_place(loc, meta, req.offset, length if inside else 0), "disk", lambda: None)
