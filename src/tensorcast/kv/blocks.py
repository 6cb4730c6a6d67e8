"""Pages that live in an engine's paged KV cache: one page is one block, cut across several regions.

Engines do not keep a block contiguous: vLLM holds one tensor per layer (K and V, ``[num_blocks, ...]``),
SGLang a host pool per layer or page-first. ``BlockRegions`` describes such a cache as R regions, each a
2-D byte array ``[num_blocks, region_bytes]`` (one row per block); page ``b`` is the concatenation of row
``b`` of every region, in order. ``gather`` and ``scatter`` move many blocks between the regions and a
contiguous ``[n, page_bytes]`` array, ``load`` and ``store`` between the regions and chosen rows of any 2-D
byte array (a same-host shard home's arena seen as rows: no staging copy), each with one vectorized copy per
region (never a Python loop per page).

Owns: validating and viewing the regions (numpy arrays or CPU torch tensors, viewed as bytes without a
copy) and the per-region copies. Does not own: where pages are stored (``client.kv``) or device memory
(a GPU cache is staged through host memory by the engine's connector).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tensorcast.errors import InvalidArgument

__all__ = ["BlockRegions", "as_bytes_2d"]


def as_bytes_2d(region: Any, what: str = "region") -> np.ndarray[Any, Any]:
    """A ``[rows, bytes per row]`` uint8 view of an array or CPU tensor whose first axis is the block (no copy).
    Each row must be contiguous; rows may be strided (a slice of a larger cache)."""
    if type(region).__module__.startswith("torch"):
        if region.device.type != "cpu":
            raise InvalidArgument(f"{what}: a {region.device.type} tensor; stage device caches through host memory")
        region = region.detach()
        if region.dim() == 0 or region.shape[0] == 0 or not region[0].is_contiguous():
            raise InvalidArgument(f"{what}: needs a leading block axis with contiguous rows, got {tuple(region.shape)}")
        # numpy has no bfloat16: view the bytes first (the last axis is contiguous, so this is a view).
        region = region.reshape(region.shape[0], -1).view(__import__("torch").uint8).numpy()
    arr = np.asarray(region)
    if arr.ndim < 1 or arr.shape[0] == 0:
        raise InvalidArgument(f"{what}: needs a leading block axis, got shape {arr.shape}")
    if arr.ndim > 1 and not arr[0].flags.c_contiguous:
        raise InvalidArgument(f"{what}: each block's row must be contiguous")
    rows = arr.reshape(arr.shape[0], -1)  # a view: the inner axes are contiguous, the block stride is free
    return rows.view(np.uint8) if rows.dtype != np.uint8 else rows


class BlockRegions:
    """R regions of ``num_blocks`` rows each; a page is one row of every region, concatenated."""

    def __init__(self, regions: Sequence[Any]) -> None:
        if not regions:
            raise InvalidArgument("at least one region is needed")
        self.regions = [as_bytes_2d(r, f"region {i}") for i, r in enumerate(regions)]
        self.num_blocks = self.regions[0].shape[0]
        if any(r.shape[0] != self.num_blocks for r in self.regions):
            raise InvalidArgument(f"regions differ in block count: {[r.shape[0] for r in self.regions]}")
        widths = [r.shape[1] for r in self.regions]
        self.offsets = np.cumsum([0, *widths]).tolist()
        self.page_bytes = int(self.offsets[-1])
        if self.page_bytes == 0:
            raise InvalidArgument("regions hold no bytes")

    def block_ids(self, blocks: Sequence[int] | np.ndarray[Any, Any], n: int) -> np.ndarray[Any, Any]:
        ids = np.asarray(blocks, dtype=np.int64)
        if ids.shape != (n,):
            raise InvalidArgument(f"{n} keys but {ids.size} block ids")
        if n and (ids.min() < 0 or ids.max() >= self.num_blocks):
            raise InvalidArgument(f"block ids must be in [0, {self.num_blocks})")
        return ids

    def gather(self, ids: np.ndarray[Any, Any], out: np.ndarray[Any, Any] | None = None) -> np.ndarray[Any, Any]:
        """Rows ``ids`` as a contiguous ``[len(ids), page_bytes]`` array (one copy per region)."""
        if out is None:
            out = np.empty((len(ids), self.page_bytes), np.uint8)
        for region, a, b in zip(self.regions, self.offsets, self.offsets[1:], strict=False):
            out[:, a:b] = region[ids]
        return out

    def scatter(self, ids: np.ndarray[Any, Any], pages: np.ndarray[Any, Any]) -> None:
        """Row ``ids[i]`` of every region := its part of ``pages[i]`` (one copy per region)."""
        for region, a, b in zip(self.regions, self.offsets, self.offsets[1:], strict=False):
            region[ids] = pages[:, a:b]

    def load(self, ids: np.ndarray[Any, Any], rows: np.ndarray[Any, Any], at: np.ndarray[Any, Any]) -> None:
        """Block ``ids[i]`` := row ``at[i]`` of ``rows`` (``[m, >= page_bytes]`` bytes), one copy per region.
        numpy gathers each region's part of the rows into a temporary of ``len(ids)`` region rows (a cache-
        sized slice, not a staging copy of the pages), then scatters it into the blocks."""
        for region, a, b in zip(self.regions, self.offsets, self.offsets[1:], strict=False):
            region[ids] = rows[at, a:b]

    def store(self, ids: np.ndarray[Any, Any], rows: np.ndarray[Any, Any], at: np.ndarray[Any, Any]) -> None:
        """Row ``at[i]`` of ``rows`` := block ``ids[i]`` (the reverse of ``load``), one copy per region."""
        for region, a, b in zip(self.regions, self.offsets, self.offsets[1:], strict=False):
            rows[at, a:b] = region[ids]
