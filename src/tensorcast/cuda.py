"""Whether this process can use CUDA, and which device a ``"cuda[:N]"`` string names.

Owns: the lazy probe of torch with CUDA, shared by storage (the device tier), the host-to-device copy
path and the reader, so that none of them imports another for it. torch stays optional: without it,
there is no CUDA. Does not own: any copy or allocation on a device.
"""

from __future__ import annotations

from tensorcast.errors import InvalidArgument

__all__ = ["check_device", "cuda_available"]


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def check_device(device: str) -> str:
    """``device`` normalised to ``cuda:N``; ``InvalidArgument`` if it is not one this process has."""
    if not device.startswith("cuda"):
        raise InvalidArgument(f"device must be 'cuda' or 'cuda:N', got {device!r}")
    if not cuda_available():
        raise InvalidArgument(f"device {device!r}: this process has no CUDA device (torch with CUDA and a GPU "
                              "are needed)")
    import torch

    index = torch.device(device).index or 0
    if index >= torch.cuda.device_count():
        raise InvalidArgument(f"device {device!r}: this process has {torch.cuda.device_count()} CUDA devices")
    return f"cuda:{index}"
