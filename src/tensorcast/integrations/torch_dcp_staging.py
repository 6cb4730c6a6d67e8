"""Staging a state dict for ``dcp.async_save``: the host copy training may not change.

Owns: copying every tensor of a nested state dict (a DTensor's local shard, rewrapped) into host buffers,
with CUDA into pinned buffers kept from one save to the next and copied without blocking, and listing the
buffers a staged copy holds so the next save reuses them. Does not own: when staging happens or waiting for
the copies (``integrations.torch_dcp``'s ``TensorCastWriter``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["stage_copy", "staged_buffers"]


def stage_copy(value: Any, cache: dict[str, Any] | None, pin: bool, path: str = "") -> Any:
    """``value`` with every tensor copied into a host buffer (``cache``'s buffer for its path when the shape
    and dtype still match; pinned, and copied without blocking, when ``pin``)."""
    if isinstance(value, DTensor):
        local = stage_copy(value.to_local(), cache, pin, path)
        return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False,
                                  shape=value.shape, stride=value.stride())
    if isinstance(value, torch.Tensor):
        held = cache.get(path) if cache is not None else None
        if held is None or held.shape != value.shape or held.dtype != value.dtype:
            held = torch.empty(value.shape, dtype=value.dtype, pin_memory=pin and torch.cuda.is_available())
        held.copy_(value.detach(), non_blocking=pin)
        return held
    if isinstance(value, Mapping):
        return {k: stage_copy(v, cache, pin, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(stage_copy(v, cache, pin, f"{path}.{i}") for i, v in enumerate(value))
    return value


def staged_buffers(value: Any, path: str = "", out: dict[str, Any] | None = None) -> dict[str, Any]:
    """The host buffers a staged copy holds, by path (``stage_copy``'s cache for the next save)."""
    out = {} if out is None else out
    if isinstance(value, DTensor):
        out[path] = value.to_local()
    elif isinstance(value, torch.Tensor):
        out[path] = value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            staged_buffers(v, f"{path}.{k}", out)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            staged_buffers(v, f"{path}.{i}", out)
    return out
