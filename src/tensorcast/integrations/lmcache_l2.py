"""An LMCache multi-process mode L2 adapter on TensorCast KV pages: ``TensorCastL2Adapter``.

LMCache's cache server (``lmcache server``, multi-process mode) loads it as a plug-in::

    --l2-adapter '{"type": "plugin", "module_path": "tensorcast.integrations.lmcache_l2",
                   "class_name": "TensorCastL2Adapter", "adapter_params": {"address": "HOST:PORT"}}'

``adapter_params`` (``TensorCastL2AdapterConfig``, found by LMCache by its name): ``address`` (default
``TENSORCAST_ADDRESS``), ``token``, ``ttl``, ``namespace``, ``threads`` and ``max_page_bytes``, as for
``integrations.lmcache.TensorCastConnector``, whose page format this adapter shares: a head page under
``lmc-mp/[NAMESPACE/]MODEL@KV_RANK@GROUP@SALT@HASH`` (LMCache's ``ObjectKey``) with the header and, for an
object larger than a page, tails. A load checks the stored layout (shapes, dtypes, format, length)
against the buffer LMCache gives and the checksum over the bytes: any mismatch is a failed load of that
object, never wrong bytes.

Tasks run on this adapter's threads; each completion is recorded and signalled on the event fd of its
kind (store, lookup, load), as LMCache's controllers expect. The pool keeps pages by TTL and LRU and
cannot pin them: "lookup and lock" is a lookup, unlock is a no-op, and a page that left the pool between
lookup and load is a failed load (LMCache then treats the object as absent). The adapter declares no
capacity (the pool evicts on its own), so LMCache runs no global L2 eviction for it.

Owns: the L2 task bookkeeping and ``ObjectKey`` naming. Does not own: the page format
(``integrations.lmcache``) or where pages live (``client.kv``).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.platform import create_event_notifier

from tensorcast.errors import InvalidArgument, TensorCastError
from tensorcast.integrations.lmcache import OPTIONS, ChunkMeta, byte_view, connect_pages

__all__ = ["TensorCastL2Adapter", "TensorCastL2AdapterConfig", "object_name"]

log = logging.getLogger("lmcache.tensorcast")


def object_name(key: Any) -> str:
    """An ``ObjectKey`` as a string: every field that tells one object from another."""
    return f"{key.model_name}@{key.kv_rank:x}@{key.object_group_id}@{key.cache_salt}@{key.chunk_hash.hex()}"


class TensorCastL2AdapterConfig(L2AdapterConfigBase):
    """``adapter_params`` of ``TensorCastL2Adapter``."""

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        self.options = dict(options or {})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorCastL2AdapterConfig:
        unknown = set(d) - set(OPTIONS)
        if unknown:
            raise ValueError(f"unknown TensorCast L2 adapter options {sorted(unknown)}; known: {list(OPTIONS)}")
        return cls(d)

    @classmethod
    def help(cls) -> str:
        return ("TensorCast L2 adapter options: address (HOST:PORT, default TENSORCAST_ADDRESS), token, ttl "
                "(seconds), namespace (a word in every key), threads (4), max_page_bytes (the homes' limit)")


class TensorCastL2Adapter(L2AdapterInterface):
    """LMCache's ``L2AdapterInterface`` on TensorCast (thread-safe: LMCache's store and prefetch
    controllers call it from their threads)."""

    def __init__(self, config: TensorCastL2AdapterConfig | Mapping[str, Any] | None = None,
                 l1_memory_desc: Any = None) -> None:
        super().__init__(max_capacity_bytes=0)
        if not isinstance(config, TensorCastL2AdapterConfig):
            config = TensorCastL2AdapterConfig.from_dict(dict(config or {}))
        self.pages = connect_pages(config.options, "lmc-mp")
        self._threads = ThreadPoolExecutor(int(config.options.get("threads") or 4),
                                           thread_name_prefix="tensorcast-lmcache-l2")
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stores: dict[int, Any] = {}
        self._lookups: dict[int, Any] = {}
        self._loads: dict[int, Any] = {}
        # Three distinct fds: LMCache's controllers dispatch completions by fd.
        self._store_fd, self._lookup_fd, self._load_fd = (create_event_notifier() for _ in range(3))

    def get_store_event_fd(self) -> int:
        return int(self._store_fd.fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._lookup_fd.fileno())

    def get_load_event_fd(self) -> int:
        return int(self._load_fd.fileno())

    def _submit(self, done: dict[int, Any], notifier: Any, work: Callable[[], Any], failed: Callable[[], Any]) -> int:
        """Run ``work`` on a pool thread; its result (``failed()`` if it raised) is recorded, then signalled:
        a task LMCache submitted always completes."""
        task = next(self._ids)

        def run() -> None:
            try:
                result = work()
            except Exception:
                log.exception("TensorCast: an LMCache L2 task failed")
                result = failed()
            with self._lock:
                done[task] = result
            notifier.notify()

        self._threads.submit(run)
        return task

    # ----------------------------------------------------------------- store
    def submit_store_task(self, keys: list[Any], objects: list[Any]) -> int:
        return self._submit(self._stores, self._store_fd, lambda: self._store(keys, objects),
                            lambda: L2StoreResult(False, 0))

    def _store(self, keys: list[Any], objects: list[Any]) -> Any:
        try:
            sent = self.pages.store([object_name(k) for k in keys], objects)
        except TensorCastError as exc:
            log.warning("TensorCast: storing %d LMCache objects failed: %s", len(keys), exc)
            return L2StoreResult(False, 0)
        sizes = [len(byte_view(objects[i].byte_array)) for i in sent]
        if sent:
            self._notify_keys_stored([keys[i] for i in sent], sizes)
        return L2StoreResult(True, sum(sizes))

    def pop_completed_store_tasks(self) -> dict[int, Any]:
        with self._lock:
            done, self._stores = self._stores, {}
        return done

    # ----------------------------------------------------------------- lookup
    def submit_lookup_and_lock_task(self, keys: list[Any], group_layout_descs: Any = None) -> int:
        return self._submit(self._lookups, self._lookup_fd, lambda: self._lookup(keys),
                            lambda: Bitmap(len(keys)))

    def _lookup(self, keys: list[Any]) -> Any:
        found = Bitmap(len(keys))
        try:
            for i, hit in enumerate(self.pages.present([object_name(k) for k in keys])):
                if hit:
                    found.set(i)
        except TensorCastError as exc:
            log.warning("TensorCast: looking up %d LMCache objects failed: %s", len(keys), exc)
        return found

    def query_lookup_and_lock_result(self, task_id: int) -> Any:
        with self._lock:
            return self._lookups.pop(task_id, None)

    def submit_unlock(self, keys: list[Any]) -> None:
        """Nothing to do: lookups lock nothing (the pool cannot pin pages)."""

    # ----------------------------------------------------------------- load
    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> int:
        return self._submit(self._loads, self._load_fd, lambda: self._load(keys, objects),
                            lambda: Bitmap(len(keys)))

    def _load(self, keys: list[Any], objects: list[Any]) -> Any:
        if len(keys) != len(objects):
            raise InvalidArgument(f"{len(keys)} keys for {len(objects)} objects")  # recorded as all failed

        def target(i: int, meta: ChunkMeta) -> tuple[Any, memoryview] | None:
            if meta != ChunkMeta.of(objects[i], meta.length):  # another layout than LMCache's buffer
                log.warning("TensorCast: %s is stored with another layout; a miss", keys[i])
                return None
            return objects[i], byte_view(objects[i].byte_array)

        loaded = Bitmap(len(keys))
        try:
            got = self.pages.load([object_name(k) for k in keys], target, lambda o: None)
        except TensorCastError as exc:
            log.warning("TensorCast: loading %d LMCache objects failed: %s", len(keys), exc)
            return loaded
        for i, obj in enumerate(got):
            if obj is not None:
                loaded.set(i)
        if any(o is not None for o in got):
            self._notify_keys_accessed([k for k, o in zip(keys, got, strict=True) if o is not None])
        return loaded

    def query_load_result(self, task_id: int) -> Any:
        with self._lock:
            return self._loads.pop(task_id, None)

    def close(self) -> None:
        self._threads.shutdown(wait=True)
        self.pages.client.close()
        for notifier in (self._store_fd, self._lookup_fd, self._load_fd):
            notifier.close()
