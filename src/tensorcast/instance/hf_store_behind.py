"""Storing a prefill's new KV pages after the prefill has replied (the HF adaptor's
``kv_store_in_background``), as engines with a write-back KV cache do (SGLang's HiCache writes to its
storage backend after the request, not before its first token).

Owns: ``StoreBehind``, one daemon thread that runs page stores in the order the prefills submitted them,
the pending store of each request (``wait``), and completing each request's report: its page count when the
store is done, ``degraded`` when it failed (pages are a cache: the request was served either way), and the
adaptor's running counters (``ReuseStats``) updated once the report is final. A daemon thread, so a store
stuck on an unreachable page store never holds up the process's exit (the pages are then simply not
stored). Does not own: what a store writes (``hf_pages.store_pages``) or when the adaptor asks for one.

Correctness rests on the cache tensors being immutable once the prefill returns: transformers' dynamic
cache appends by concatenation into new tensors and crops by slicing, so the next turn of the session,
running meanwhile, never changes the tensors a pending store reads.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable

from tensorcast.instance.hf_pages import ReuseReport, ReuseStats

__all__ = ["StoreBehind"]

log = logging.getLogger("tensorcast.instance")


class StoreBehind:
    """Page stores run one after another on a thread of their own, after their prefill replied."""

    def __init__(self, stats: ReuseStats, stats_lock: threading.Lock) -> None:
        self._stats, self._stats_lock = stats, stats_lock
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], ReuseReport,
                                             concurrent.futures.Future[None]]] = queue.SimpleQueue()
        self._pending: dict[str, concurrent.futures.Future[None]] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kv-store-behind", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, store: Callable[[], None], report: ReuseReport) -> None:
        """Run ``store`` (which fills ``report``) after the stores submitted before it."""
        report.store_pending = True
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            self._pending[request_id] = fut
        fut.add_done_callback(lambda f: self._forget(request_id, f))
        self._queue.put((store, report, fut))

    def _forget(self, request_id: str, fut: concurrent.futures.Future[None]) -> None:
        with self._lock:
            if self._pending.get(request_id) is fut:
                del self._pending[request_id]

    def _run(self) -> None:
        while True:
            store, report, fut = self._queue.get()
            try:
                store()
            except Exception as exc:  # a page store that fails leaves the request served, its pages unstored
                report.degraded = f"store: {exc}"
                log.warning("KV page store after the reply failed: %s", exc)
            finally:
                report.store_pending = False
                with self._stats_lock:
                    self._stats.add(report)
                fut.set_result(None)

    def wait(self, request_id: str | None = None, timeout: float | None = None) -> None:
        """Until ``request_id``'s store is done (every store submitted so far, when None)."""
        with self._lock:
            futs = list(self._pending.values()) if request_id is None else \
                [f for f in [self._pending.get(request_id)] if f is not None]
        concurrent.futures.wait(futs, timeout=timeout)

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)
