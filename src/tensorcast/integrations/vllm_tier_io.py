"""The I/O of the vLLM tier: units of KV between vLLM's CPU primary region and the pool, off the caller's thread.

Owns: running each store and load as a job on a small thread pool (the scheduler that submits it never waits
on the network), reading a unit straight out of its primary-region row into the pool (``kv.put`` of views, no
staging copy) and receiving it straight into the row it goes to (``kv.get_into``), the parts of a unit larger
than one page, lookups (``present`` of every part: a unit is there only if all of it is), and the results
handed back as they finish: per load, which units arrived whole (a unit that went missing between lookup and
load is a miss, never partly written data the engine would use). Bounded: at most ``max_inflight`` jobs run
at once, the rest wait in order. Does not own: vLLM's interfaces (``integrations.vllm_tier``), keys
(``integrations.vllm_block_keys``) or the pool.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorcast.errors import InvalidArgument, TensorCastError
from tensorcast.integrations.vllm_block_keys import part_keys

__all__ = ["Finished", "TierIO"]

log = logging.getLogger("vllm.tensorcast")


@dataclass(frozen=True)
class Finished:
    job_id: int
    success: bool
    ok: tuple[int, ...] | None  # loads that failed in part: the indexes of the units that arrived whole
    seconds: float
    nbytes: int


class TierIO:
    """``rows``: the primary region as a (chunks, row bytes) uint8 array; a unit is the first ``unit_bytes`` of
    its row. ``client``: a connected ``tensorcast`` client (its KV calls are thread-safe)."""

    def __init__(self, client: Any, rows: np.ndarray[Any, Any], unit_bytes: int, *, ttl: float | None = None,
                 threads: int = 4, max_page_bytes: int | None = None) -> None:
        if rows.ndim != 2 or rows.dtype != np.uint8 or not 0 < unit_bytes <= rows.shape[1]:
            raise InvalidArgument(f"a primary region of rows {rows.shape} ({rows.dtype}) cannot hold units of "
                                  f"{unit_bytes} bytes")
        self.client = client
        self.rows = rows
        self.unit_bytes = unit_bytes
        self.ttl = ttl
        self.max_page_bytes = max_page_bytes or int(client.aio.config.kv.max_page_bytes)
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="tensorcast-tier")
        self._done: queue.SimpleQueue[Finished] = queue.SimpleQueue()
        self._inflight = 0
        self._idle = threading.Condition()
        self.stats = {"stored": 0, "loaded": 0, "load_misses": 0, "failed_jobs": 0}

    # ----------------------------------------------------------------- lookups
    def parts(self, key: str) -> list[tuple[str, int, int]]:
        return part_keys(key, self.unit_bytes, self.max_page_bytes)

    def present(self, keys: Sequence[str]) -> list[bool]:
        """Whether each unit is in the pool, whole (one batched lookup; same-host homes answer from memory)."""
        parts = [self.parts(k) for k in keys]
        flat = [p[0] for ps in parts for p in ps]
        hits = self.client.kv.present(flat) if flat else []
        out, i = [], 0
        for ps in parts:
            out.append(all(hits[i:i + len(ps)]))
            i += len(ps)
        return out

    # ----------------------------------------------------------------- jobs
    def store(self, job_id: int, keys: Sequence[str], chunk_ids: Sequence[int]) -> None:
        """Copy these rows' units into the pool; the rows must stay unchanged until the job finishes."""
        self._submit(job_id, lambda: self._store(keys, chunk_ids))

    def load(self, job_id: int, keys: Sequence[str], chunk_ids: Sequence[int]) -> None:
        """Receive these units into these rows."""
        self._submit(job_id, lambda: self._load(keys, chunk_ids))

    def finished(self) -> list[Finished]:
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until no job is running or queued (their results stay for ``finished``)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)

    def _submit(self, job_id: int, work: Callable[[], tuple[bool, tuple[int, ...] | None, int]]) -> None:
        with self._idle:
            self._inflight += 1

        def run() -> None:
            start = time.monotonic()
            try:
                success, ok, nbytes = work()
            except TensorCastError as exc:  # the pool refused or was unreachable: the engine recomputes
                log.warning("TensorCast tier: job %d failed: %s", job_id, exc)
                success, ok, nbytes = False, None, 0
            except Exception:
                log.exception("TensorCast tier: job %d failed", job_id)
                success, ok, nbytes = False, None, 0
            if not success:
                self.stats["failed_jobs"] += 1
            self._done.put(Finished(job_id, success, ok, time.monotonic() - start, nbytes))
            with self._idle:
                self._inflight -= 1
                self._idle.notify_all()

        self._pool.submit(run)

    def _views(self, keys: Sequence[str], chunk_ids: Sequence[int]) -> tuple[list[str], list[memoryview], list[int]]:
        """Every part's key and its view in the primary region, and which unit each part belongs to."""
        if len(keys) != len(chunk_ids):
            raise InvalidArgument(f"{len(keys)} keys for {len(chunk_ids)} chunks")
        names: list[str] = []
        views: list[memoryview] = []
        owner: list[int] = []
        for i, (key, chunk) in enumerate(zip(keys, chunk_ids, strict=True)):
            row = memoryview(self.rows[int(chunk)])
            for name, a, b in self.parts(key):
                names.append(name)
                views.append(row[a:b])
                owner.append(i)
        return names, views, owner

    def _store(self, keys: Sequence[str], chunk_ids: Sequence[int]) -> tuple[bool, tuple[int, ...] | None, int]:
        names, views, _ = self._views(keys, chunk_ids)
        if names:
            self.client.kv.put(names, views, ttl=self.ttl)
        self.stats["stored"] += len(keys)
        return True, None, len(keys) * self.unit_bytes

    def _load(self, keys: Sequence[str], chunk_ids: Sequence[int]) -> tuple[bool, tuple[int, ...] | None, int]:
        names, views, owner = self._views(keys, chunk_ids)
        # exact: a page of another size under this key is refused (the job fails, the engine recomputes),
        # never a hit with the rest of the row left as it was.
        hits = self.client.kv.get_into(names, views, exact=True) if names else []
        whole = [True] * len(keys)
        for hit, i in zip(hits, owner, strict=True):
            whole[i] = whole[i] and bool(hit)
        ok = tuple(i for i, w in enumerate(whole) if w)
        self.stats["loaded"] += len(ok)
        self.stats["load_misses"] += len(keys) - len(ok)
        if len(ok) == len(keys):
            return True, None, len(keys) * self.unit_bytes
        return False, ok, len(ok) * self.unit_bytes
