"""An SGLang HiCache storage backend (L3) on TensorCast KV pages: ``TensorCastHiCacheStorage``.

Loaded by SGLang as an out-of-tree backend::

    --hicache-storage-backend dynamic --hicache-mem-layout page_first
    --hicache-storage-backend-extra-config '{"backend_name": "tensorcast",
        "module_path": "tensorcast.integrations.sglang", "class_name": "TensorCastHiCacheStorage",
        "interface_v1": 1, "address": "HOST:PORT"}'

and constructed as ``cls(storage_config, kwargs)``. Extra config: ``address`` (a gateway; default
``TENSORCAST_ADDRESS``), ``token`` (the cluster token, if any), ``model_id`` (default: SGLang's storage
model name), ``generation`` (an integer in every key, default 0: bump it to retire every stored page),
``ttl`` (seconds a page is kept; default the cluster's ``kv.page_ttl``). ``interface_v1`` makes SGLang use
the zero-copy calls.

One TensorCast page is one SGLang page: the host pool's fragments of that page in the order
``get_page_buffer_meta`` lists them (page-first MHA: K then V of every layer; MLA: the one KV fragment),
which is also SGLang's flat data page for the page-first layouts, so the zero-copy and the legacy calls
read each other's pages. Keys are SGLang's page hashes behind a prefix that hashes the model, the pool's
layout (pool class, layout, dtype, page size, fragment sizes), the rank scope (TP/PP rank of an MHA
model; only the PP rank of an MLA model, whose ranks hold the same pages) and the generation: different
models, layouts or shards never read each other's pages.

Zero copy: fragment pointers from the host pool become numpy views of its memory (ctypes, no copy). A page
whose fragments are adjacent is sent from and received into the pool directly; otherwise (K and V of
page-first MHA lie apart) the batch is gathered into, or received into, one contiguous staging array and
copied out fragment by fragment: one host copy, no per-page tensors. Cluster trouble (a shard between
homes, an unreachable home) makes pages misses or failed writes, never an exception in SGLang's threads.

Owns: the SGLang-facing storage class, key naming and page assembly. Does not own: where pages live or
how they move (``client.kv``). SGLang is imported only when the class is first used, so this module
imports (and type-checks) without it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import blake3
import msgspec
import numpy as np

import tensorcast as tc
from tensorcast.errors import InvalidArgument, TensorCastError

__all__ = ["TensorCastHiCacheStorage"]  # noqa: F822 (made by __getattr__ on first use: it needs SGLang)

log = logging.getLogger("sglang.tensorcast")  # beside SGLang's own lines
_ENC = msgspec.msgpack.Encoder()
_SGLANG_STORAGE_MODULE = "sglang.srt.mem_cache.hicache_storage"


def _view(address: int, nbytes: int) -> np.ndarray[Any, Any]:
    """``nbytes`` of host memory at ``address`` as a writable uint8 array (no copy)."""
    return np.frombuffer(memoryview((ctypes.c_uint8 * nbytes).from_address(address)).cast("B"), np.uint8)


def _as_bytes(value: Any) -> np.ndarray[Any, Any]:
    """A flat uint8 view of a contiguous CPU tensor or array (no copy)."""
    if type(value).__module__.startswith("torch"):
        value = value.detach().contiguous().reshape(-1).view(__import__("torch").uint8).numpy()
    return np.ascontiguousarray(value).reshape(-1).view(np.uint8)


class _Pages:
    """The fragments of a batch of pages: ``pointers[i * per_page + j]`` is fragment j of page i."""

    def __init__(self, pointers: Sequence[int], lengths: Sequence[int], pages: int, page_bytes: int) -> None:
        if pages == 0 or len(pointers) % pages or len(lengths) != len(pointers):
            raise InvalidArgument(f"{len(pointers)} fragments for {pages} pages")
        self.per_page = len(pointers) // pages
        self.pointers = [int(p) for p in pointers]
        self.lengths = [int(n) for n in lengths]
        self.pages = pages
        self.page_bytes = page_bytes
        if any(sum(self.fragments(i)[1]) != page_bytes for i in range(pages)):
            raise InvalidArgument(f"host pool fragments do not add up to {page_bytes}-byte pages")

    def fragments(self, page: int) -> tuple[list[int], list[int]]:
        a, b = page * self.per_page, (page + 1) * self.per_page
        return self.pointers[a:b], self.lengths[a:b]

    def contiguous(self) -> bool:
        """Whether every page's fragments lie end to end, so a page is one run of pool memory."""
        for i in range(self.pages):
            ptrs, lens = self.fragments(i)
            if any(ptrs[j] + lens[j] != ptrs[j + 1] for j in range(len(ptrs) - 1)):
                return False
        return True

    def views(self) -> list[np.ndarray[Any, Any]]:
        return [_view(self.fragments(i)[0][0], self.page_bytes) for i in range(self.pages)]

    def gather(self) -> np.ndarray[Any, Any]:
        out = np.empty((self.pages, self.page_bytes), np.uint8)
        for i in range(self.pages):
            offset = 0
            for ptr, n in zip(*self.fragments(i), strict=True):
                out[i, offset : offset + n] = _view(ptr, n)
                offset += n
        return out

    def scatter(self, page: int, data: np.ndarray[Any, Any]) -> None:
        offset = 0
        for ptr, n in zip(*self.fragments(page), strict=True):
            _view(ptr, n)[:] = data[offset : offset + n]
            offset += n


class _Backend:
    """The storage logic; ``TensorCastHiCacheStorage`` is this plus SGLang's ``HiCacheStorage`` base."""

    def __init__(self, storage_config: Any, kwargs: Mapping[str, Any] | None = None) -> None:
        extra: dict[str, Any] = dict(storage_config.extra_config or {})
        address = extra.get("address") or os.environ.get("TENSORCAST_ADDRESS")
        if not address:
            raise InvalidArgument("the TensorCast HiCache backend needs extra_config['address'] or TENSORCAST_ADDRESS")
        model = extra.get("model_id") or storage_config.model_name
        if not model:
            raise InvalidArgument("the TensorCast HiCache backend needs a model name (extra_config['model_id'])")
        if getattr(storage_config, "should_split_heads", False) or getattr(storage_config, "dcp_size", 1) != 1:
            raise InvalidArgument("the TensorCast HiCache backend does not support split heads or decode CP")
        self.storage_config = storage_config
        self.model_id = str(model)
        self.generation = int(extra.get("generation", 0))
        self.ttl: float | None = float(extra["ttl"]) if extra.get("ttl") is not None else None
        self.client = tc.connect(str(address), extra.get("token"))
        self.mem_pool_host: Any = None
        self.page_bytes = 0
        self.fragment_lengths: tuple[int, ...] = ()
        self.key_prefix = ""
        self.lock = threading.Lock()
        self.metrics: dict[str, list[float]] = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                                                "backup_bandwidth": []}
        self.record_metrics = bool(getattr(storage_config, "enable_storage_metrics", False))

    # ----------------------------------------------------------------- setup
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the pool's page geometry (one sample page) and fix the key prefix for it."""
        import torch

        sample = torch.arange(mem_pool_host.page_size, dtype=torch.int64)
        _, lengths = mem_pool_host.get_page_buffer_meta(sample)
        page_bytes = sum(int(n) for n in lengths)
        limit = self.client.aio.config.kv.max_page_bytes
        if not 0 < page_bytes <= limit:
            raise InvalidArgument(f"an SGLang page here is {page_bytes} bytes; TensorCast pages hold 1..{limit} "
                                  "(kv.max_page_bytes): raise it on the cluster or use a smaller page size")
        self.mem_pool_host = mem_pool_host
        self.page_bytes = page_bytes
        self.fragment_lengths = tuple(int(n) for n in lengths)
        self.key_prefix = self._prefix()

    def _prefix(self) -> str:
        pool, cfg = self.mem_pool_host, self.storage_config
        # MLA ranks hold identical pages (one writer): their keys must not name the TP rank.
        scope = ([cfg.pp_rank, cfg.pp_size] if cfg.is_mla_model
                 else [cfg.tp_rank, cfg.tp_size, cfg.pp_rank, cfg.pp_size])
        doc = ["sglang-hicache-1", self.model_id, type(pool).__name__, pool.layout, str(pool.dtype),
               pool.page_size, list(self.fragment_lengths), scope, self.generation]
        return f"sglang/{blake3.blake3(_ENC.encode(doc)).hexdigest()[:32]}/"

    def _keys(self, keys: Sequence[str]) -> list[str]:
        if self.mem_pool_host is None:
            raise InvalidArgument("register_mem_pool_host first")
        return [self.key_prefix + k for k in keys]

    def _pages(self, host_indices: Any, n: int) -> _Pages:
        pointers, lengths = self.mem_pool_host.get_page_buffer_meta(host_indices)
        return _Pages(pointers, lengths, n, self.page_bytes)

    def _record(self, kind: str, pages: int, seconds: float) -> None:
        if self.record_metrics and pages:
            with self.lock:
                self.metrics[f"{kind}_pgs"].append(pages)
                self.metrics[f"{kind}_bandwidth"].append(pages * self.page_bytes / max(seconds, 1e-9) / 2**30)

    # ----------------------------------------------------------------- zero-copy calls
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading pages are stored."""
        if not keys:
            return 0
        try:
            return self.client.kv.exists(self._keys(keys))
        except TensorCastError as exc:
            log.warning("TensorCast: existence query of %d pages failed: %s", len(keys), exc)
            return 0

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Store pages straight from the host pool (``host_indices``: ``page_size`` token slots per key)."""
        if not keys:
            return []
        t0 = time.perf_counter()
        try:
            pages = self._pages(host_indices, len(keys))
            data = pages.views() if pages.contiguous() else list(pages.gather())
            self.client.kv.put(self._keys(keys), data, ttl=self.ttl)
        except TensorCastError as exc:
            log.warning("TensorCast: storing %d pages failed: %s", len(keys), exc)
            return [False] * len(keys)
        self._record("backup", len(keys), time.perf_counter() - t0)
        return [True] * len(keys)

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Load pages straight into the host pool; a page is True only once all of its bytes are there."""
        if not keys:
            return []
        t0 = time.perf_counter()
        try:
            pages = self._pages(host_indices, len(keys))
            if pages.contiguous():
                hits = self.client.kv.get_into(self._keys(keys), pages.views())
            else:
                stage = np.empty((len(keys), self.page_bytes), np.uint8)
                hits = self.client.kv.get_into(self._keys(keys), list(stage))
                for i in np.flatnonzero(hits):
                    pages.scatter(int(i), stage[i])
        except TensorCastError as exc:
            log.warning("TensorCast: loading %d pages failed: %s", len(keys), exc)
            return [False] * len(keys)
        self._record("prefetch", sum(hits), time.perf_counter() - t0)
        return [bool(h) for h in hits]

    # ----------------------------------------------------------------- legacy calls (flat pages)
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        """Each page into its target tensor (returned), or as a new tensor of the pool's dtype; None: miss."""
        import torch

        try:
            if target_locations is not None:
                hits = self.client.kv.get_into(self._keys(keys), list(target_locations))
                return [t if h else None for t, h in zip(target_locations, hits, strict=True)]
            got = self.client.kv.get(self._keys(keys))
        except TensorCastError as exc:
            log.warning("TensorCast: loading %d pages failed: %s", len(keys), exc)
            return [None] * len(keys)
        dtype = self.mem_pool_host.dtype
        return [None if g is None else torch.from_numpy(g).view(dtype) for g in got]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if values is None or len(values) != len(keys):
            raise InvalidArgument("batch_set needs one value per key")
        try:
            self.client.kv.put(self._keys(keys), [_as_bytes(v) for v in values], ttl=self.ttl)
        except TensorCastError as exc:
            log.warning("TensorCast: storing %d pages failed: %s", len(keys), exc)
            return False
        return True

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ----------------------------------------------------------------- housekeeping
    def clear(self) -> None:
        """Retire every page this backend stored: move to the next key generation. Pages are shared and
        are not deleted (they expire by TTL or LRU); every rank and instance that SGLang clears moves on
        in step, since the generation advances by one."""
        self.generation += 1
        if self.mem_pool_host is not None:
            self.key_prefix = self._prefix()
        log.info("TensorCast: HiCache storage cleared: key generation %d", self.generation)

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (pages and GB/s per batched get and put)."""
        import importlib

        stats = importlib.import_module("sglang.srt.observability.metrics_collector").StorageMetrics()
        with self.lock:
            for name, values in self.metrics.items():
                getattr(stats, name).extend(values)
                values.clear()
        return stats

    def close(self) -> None:
        self.client.close()


_CLASS: type | None = None


def _storage_class() -> type:
    """``_Backend`` with SGLang's ``HiCacheStorage`` as a base, made on first use (imports SGLang)."""
    global _CLASS
    if _CLASS is None:
        import importlib

        base = importlib.import_module(_SGLANG_STORAGE_MODULE).HiCacheStorage
        _CLASS = type(base)("TensorCastHiCacheStorage", (_Backend, base),
                            {"__module__": __name__, "__doc__": _Backend.__doc__})
    return _CLASS


def __getattr__(name: str) -> Any:
    if name == "TensorCastHiCacheStorage":
        return _storage_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
