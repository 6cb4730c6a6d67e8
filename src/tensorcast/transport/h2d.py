"""Host-to-device copies of many tensors, pipelined through a few staging buffers.

Owns: cutting a batch of host byte ranges (mapped pool memory, a mapped checkpoint file, fetched bytes)
into chunks (``plan_chunks``, pure), and running them through ``buffers`` staging buffers: one thread per
buffer waits until the buffer's previous device copy is done, fills it (this is where a mapped file is
actually read from disk or the page cache, and where pool pages are touched), and enqueues the copy of
that chunk into its destination. With N buffers, N-1 fills overlap with the copy in flight.

The device side sits behind ``CopyEngine``: ``CudaCopyEngine`` (pinned host buffers, one CUDA stream
and event per buffer; needs torch with CUDA) and ``HostCopyEngine`` (CPU destinations, synchronous
copies: the CPU path, and the same pipeline under test without a GPU). Does not own: where the host
bytes come from (``client.reads``), or keeping device memory alive (the caller owns the tensors).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from tensorcast.cuda import cuda_available
from tensorcast.errors import InvalidArgument
from tensorcast.records import TensorMeta
from tensorcast.tensors import dtype_name, numpy_dtype, wrap_bytes

__all__ = ["Chunk", "CopyEngine", "CudaCopyEngine", "HostCopyEngine", "plan_chunks", "to_device"]

DEFAULT_CHUNK = 32 * 1024 * 1024
DEFAULT_BUFFERS = 3


@dataclass(frozen=True, slots=True)
class Chunk:
    """Bytes ``[offset, offset + nbytes)`` of tensor ``index``, staged in buffer ``buffer``."""

    index: int
    offset: int
    nbytes: int
    buffer: int


def plan_chunks(sizes: Sequence[int], chunk: int, buffers: int) -> list[Chunk]:
    """Cut every tensor into pieces of at most ``chunk`` bytes, assigned to buffers round-robin."""
    if chunk <= 0 or buffers <= 0:
        raise InvalidArgument("chunk and buffers must be positive")
    out: list[Chunk] = []
    for i, size in enumerate(sizes):
        for a in range(0, size, chunk):
            out.append(Chunk(i, a, min(chunk, size - a), len(out) % buffers))
    return out


class CopyEngine(Protocol):
    """The device side of the pipeline. ``staging`` buffers are filled by one thread each; ``copy``
    enqueues a staged chunk into ``dest`` and may return before it is done; ``wait`` blocks until the
    buffer's last copy has finished (so that it can be refilled); ``finish`` waits for all."""

    def staging(self, count: int, nbytes: int) -> list[memoryview]: ...

    def empty(self, shape: tuple[int, ...], dtype: str) -> Any: ...

    def copy(self, buffer: int, nbytes: int, dest: Any, dest_offset: int) -> None: ...

    def wait(self, buffer: int) -> None: ...

    def finish(self) -> None: ...


class HostCopyEngine:
    """CPU destinations (numpy arrays or CPU torch tensors); every copy completes at once."""

    def __init__(self, like: str = "torch") -> None:
        self.like = like
        self._bufs: list[np.ndarray[Any, Any]] = []

    def staging(self, count: int, nbytes: int) -> list[memoryview]:
        self._bufs = [np.empty(nbytes, np.uint8) for _ in range(count)]
        return [memoryview(b.data) for b in self._bufs]

    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        arr = np.empty(shape, numpy_dtype(dtype))
        if self.like == "numpy":
            return arr
        return wrap_bytes(arr.reshape(-1).view(np.uint8) if arr.nbytes else None,
                          TensorMeta(name="", dtype=dtype, shape=shape, nbytes=arr.nbytes, digest=""), self.like)

    def copy(self, buffer: int, nbytes: int, dest: Any, dest_offset: int) -> None:
        flat = _host_bytes(dest)
        flat[dest_offset : dest_offset + nbytes] = self._bufs[buffer][:nbytes]

    def wait(self, buffer: int) -> None:
        return None

    def finish(self) -> None:
        return None


class CudaCopyEngine:
    """Pinned staging buffers and one CUDA stream + event per buffer (torch with CUDA)."""

    def __init__(self, device: str) -> None:
        import torch

        if not cuda_available():
            raise InvalidArgument(f"device {device!r}: this process has no CUDA device "
                                  "(torch.cuda.is_available() is False); use device='cpu'")
        self.torch = torch
        self.device = torch.device(device)
        self._pinned: list[Any] = []
        self._streams: list[Any] = []
        self._events: list[Any] = []

    def staging(self, count: int, nbytes: int) -> list[memoryview]:
        torch = self.torch
        self._pinned = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(count)]
        self._streams = [torch.cuda.Stream(device=self.device) for _ in range(count)]
        self._events = [None] * count
        return [memoryview(p.numpy()) for p in self._pinned]

    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        return self.torch.empty(shape, dtype=getattr(self.torch, dtype), device=self.device)

    def copy(self, buffer: int, nbytes: int, dest: Any, dest_offset: int) -> None:
        torch = self.torch
        stream = self._streams[buffer]
        with torch.cuda.stream(stream):
            flat = dest.view(-1).view(torch.uint8) if dest.numel() else dest
            flat[dest_offset : dest_offset + nbytes].copy_(self._pinned[buffer][:nbytes], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        self._events[buffer] = event

    def wait(self, buffer: int) -> None:
        event = self._events[buffer]
        if event is not None:
            event.synchronize()

    def finish(self) -> None:
        for i in range(len(self._streams)):
            self.wait(i)
        # The destinations are used on other streams next: make the current stream wait for ours.
        current = self.torch.cuda.current_stream(self.device)
        for s in self._streams:
            current.wait_stream(s)


def _host_bytes(t: Any) -> np.ndarray[Any, Any]:
    """A flat uint8 view of a host tensor/array (no copy unless it is not contiguous)."""
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t).reshape(-1).view(np.uint8)
    import torch

    return np.asarray(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def to_device(tensors: Mapping[str, Any], device: str, *, engine: CopyEngine | None = None,
              chunk: int = DEFAULT_CHUNK, buffers: int = DEFAULT_BUFFERS) -> dict[str, Any]:
    """Copies of host ``tensors`` (torch or numpy; possibly lazily mapped) on ``device``, pipelined through
    ``buffers`` staging buffers of ``chunk`` bytes. ``device='cpu'`` without an engine returns them as is."""
    if engine is None:
        if device == "cpu":
            return dict(tensors)
        if not device.startswith("cuda"):
            raise InvalidArgument(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
        engine = CudaCopyEngine(device)
    names = list(tensors)
    metas = [(_shape(tensors[n]), dtype_name(tensors[n].dtype)) for n in names]
    sources = [_host_bytes(tensors[n]) for n in names]
    out = [engine.empty(shape, dtype) for shape, dtype in metas]
    plan = plan_chunks([len(s) for s in sources], chunk, buffers)
    if plan:
        staging = engine.staging(min(buffers, len(plan)), min(chunk, max(c.nbytes for c in plan)))
        failed: list[BaseException] = []
        lock = threading.Lock()

        def run(buffer: int) -> None:
            for c in plan:
                if c.buffer != buffer:
                    continue
                with lock:
                    if failed:
                        return
                try:
                    engine.wait(buffer)  # its previous chunk has left the staging buffer
                    staging[buffer][: c.nbytes] = sources[c.index][c.offset : c.offset + c.nbytes].data
                    engine.copy(buffer, c.nbytes, out[c.index], c.offset)
                except BaseException as exc:
                    with lock:
                        failed.append(exc)
                    return

        with ThreadPoolExecutor(max_workers=len(staging), thread_name_prefix="tensorcast-h2d") as ex:
            list(ex.map(run, range(len(staging))))
        engine.finish()
        if failed:
            raise failed[0]
    return dict(zip(names, out, strict=True))


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in t.shape)

