"""Checks a rollout engine runs on a weight version it read from the pool before it loads it: the same
tensors as the model it serves, and the bytes that were published.

Owns ``check_compatible`` (names, dtypes and shapes against the version loaded first) and ``check_digests``
(every tensor read against its content digest: what landed is what was published), and the raw bytes of a
tensor they are checked on. Pure but for hashing.
Used by the vLLM weight-transfer backend (``integrations.vllm_transfer``) and the verl checkpoint engine
(``integrations.verl``). Does not own: reading the version, or loading it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from tensorcast.errors import InvalidArgument, clip
from tensorcast.records import ArtifactInfo
from tensorcast.tensors import digest_bytes, dtype_name
from tensorcast.weights.versions import META_TENSORS

__all__ = ["Layout", "check_compatible", "check_digests", "layout_of", "layout_of_info", "raw_bytes"]

# name -> (dtype, shape): what vLLM's loaders were given (dtypes by TensorCast's names: "float32", "bfloat16")
Layout = dict[str, tuple[str, tuple[int, ...]]]


def layout_of(tensors: dict[str, Any]) -> Layout:
    return {name: (dtype_name(t.dtype), tuple(t.shape)) for name, t in tensors.items()}


def layout_of_info(info: ArtifactInfo) -> Layout:
    """The layout of a version's weights as its record states them (its tag and delta record left out)."""
    return {t.name: (t.dtype, tuple(t.shape)) for t in info.tensors if t.name not in META_TENSORS}


def check_compatible(loaded: Layout | None, staged: Layout) -> None:
    """``InvalidArgument`` naming what differs when the staged version does not have the tensors (names,
    dtypes, shapes) of the version loaded first (``loaded``; None: nothing loaded through this engine yet)."""
    if not staged:
        raise InvalidArgument("the version holds no tensors")
    if loaded is None:
        return
    missing, extra = sorted(loaded.keys() - staged.keys()), sorted(staged.keys() - loaded.keys())
    if missing or extra:
        raise InvalidArgument(f"the version's tensors differ from the loaded model's: missing {clip(missing)}, "
                              f"unknown {clip(extra)}")
    changed = sorted(n for n in staged if staged[n] != loaded[n])
    if changed:
        n = changed[0]
        raise InvalidArgument(f"{len(changed)} tensors changed dtype or shape, e.g. {clip(n)}: "
                              f"{loaded[n]} -> {staged[n]}")


def check_digests(info: ArtifactInfo, tensors: Mapping[str, Any], what: str) -> None:
    """``InvalidArgument`` naming the first tensor (torch or numpy, any dtype) whose bytes are not the ones
    ``info`` records for it."""
    digests = {t.name: t.digest for t in info.tensors}
    for name, t in tensors.items():
        if digest_bytes(raw_bytes(t)) != digests.get(name):
            raise InvalidArgument(f"tensor {clip(name)} of {what} does not match its published digest")


def raw_bytes(t: Any) -> Any:
    """The bytes of a torch tensor (bfloat16 included, which numpy cannot hold) or a numpy array."""
    if hasattr(t, "contiguous"):
        import torch

        return t.contiguous().reshape(-1).view(torch.uint8).numpy()
    return np.ascontiguousarray(t).reshape(-1).view(np.uint8)
