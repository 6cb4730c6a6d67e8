"""The KV events of one shard home's page store: what it tells routers about the pages it holds.

Owns ``PageEvents``, the buffer a ``kv.pages.PageStore`` tells of every page committed and freed, cut into one
``KVEventBatch`` per turn of its owner's event loop. Does not own: the records (``tensorcast.kv_events``), the
sockets (``tensorcast.kv_event_stream``) or when pages come and go (``kv.pages``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tensorcast.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, block_hash_of, event_of

__all__ = ["PageEvents"]


class PageEvents:
    """Events of one page store, one batch per turn of its owner's loop.

    ``stored``/``removed`` are called by the store on its owner's thread (cheap: a list append); the first of a
    turn asks ``schedule`` (the loop's ``call_soon``) to run ``flush`` after it, which hands the turn's events,
    as one ``KVEventBatch``, to ``publish``. Runs of the same kind and group become one event. A page that
    comes and goes within one turn is reported both ways, in order."""

    def __init__(self, publish: Callable[[KVEventBatch], None], schedule: Callable[[Callable[[], None]], Any], *,
                 clock: Callable[[], float] = time.time) -> None:
        self._publish = publish
        self._schedule = schedule
        self._clock = clock
        self._pending: list[tuple[bool, str]] = []  # (stored?, key) in order

    def stored(self, key: str) -> None:
        self._add(True, key)

    def removed(self, key: str) -> None:
        self._add(False, key)

    def cleared(self) -> None:
        """Every page of this store is gone (it started empty, or closed): subscribers drop what they knew."""
        self.flush()
        self._publish(KVEventBatch(ts=self._clock(), events=[AllBlocksCleared()]))

    def _add(self, stored: bool, key: str) -> None:
        if not self._pending:
            self._schedule(self.flush)
        self._pending.append((stored, key))

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        run: list[bytes | int] = []
        kind: tuple[bool, int | None] | None = None
        for stored, key in pending:
            h, group = block_hash_of(key)
            if (stored, group) != kind and run:
                events.append(event_of(kind, run))
                run = []
            kind = (stored, group)
            run.append(h)
        events.append(event_of(kind, run))
        self._publish(KVEventBatch(ts=self._clock(), events=events))

