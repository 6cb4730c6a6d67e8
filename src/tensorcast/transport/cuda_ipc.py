"""CUDA IPC: a worker's GPU tensors opened by another process on the same host, without a copy.

Owns: turning a CUDA tensor into a ``CudaIpcHandle`` (the fields ``torch.multiprocessing`` would pickle:
the allocation's ``cudaIpcMemHandle``, the tensor's place in it, and torch's shared reference counter
that keeps the producer from freeing memory a consumer still uses) and back. Plain fields travel on the
wire, so nothing is unpickled. Needs torch with CUDA on both sides; the import is lazy. Does not own:
which tensors a worker keeps on a device (``pool.device``).
"""

from __future__ import annotations

from typing import Any

from tensorcast.errors import InvalidArgument
from tensorcast.records import CudaIpcHandle

__all__ = ["export_handle", "import_handle"]


def export_handle(tensor: Any) -> CudaIpcHandle:
    """The handle of a CUDA tensor held by this process (which must keep it alive while it is shared)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    if tensor.device.type != "cuda":
        raise InvalidArgument(f"only CUDA tensors have IPC handles, got device {tensor.device}")
    rebuild, args = reduce_tensor(tensor.detach())  # type: ignore[no-untyped-call]
    if rebuild is not rebuild_cuda_tensor:
        raise InvalidArgument(f"tensor cannot be shared with CUDA IPC (reduced with {rebuild.__name__})")
    (_cls, size, stride, offset, _storage_cls, dtype, device, handle, storage_size, storage_offset,
     _requires_grad, ref_handle, ref_offset, event_handle, event_sync) = args
    return CudaIpcHandle(shape=tuple(size), stride=tuple(stride), tensor_offset=int(offset),
                         dtype=str(dtype).removeprefix("torch."), device=int(device), storage_handle=bytes(handle),
                         storage_size=int(storage_size), storage_offset=int(storage_offset),
                         ref_counter_handle=bytes(ref_handle), ref_counter_offset=int(ref_offset),
                         event_handle=None if event_handle is None else bytes(event_handle),
                         event_sync_required=bool(event_sync))


def import_handle(h: CudaIpcHandle) -> Any:
    """Open a handle from another process: a tensor aliasing that process's device memory."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if not torch.cuda.is_available():
        raise InvalidArgument("a CUDA IPC handle needs a CUDA device in this process")
    return rebuild_cuda_tensor(  # type: ignore[no-untyped-call]
        torch.Tensor, torch.Size(h.shape), h.stride, h.tensor_offset, torch.storage.TypedStorage,
        getattr(torch, h.dtype), h.device, h.storage_handle, h.storage_size, h.storage_offset, False,
        h.ref_counter_handle, h.ref_counter_offset, h.event_handle, h.event_sync_required)
