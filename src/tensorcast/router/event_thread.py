"""The router's KV event streams, followed on a thread of their own.

Owns: ``EventThread``, which runs a ``policies.EventFeed`` off the router's event loop: it applies the batches
as they arrive and follows the pool's shard homes it is handed (``follow``: each survey of the cluster's
workers). Why a thread: following a stream is network waits (a new stream's replay, a gap's replay: up to
seconds when a publisher is gone), which on the loop would hold up every request the router forwards. The
index is changed under the feed's lock only; the router takes that lock around each decision, which reads it.
Does not own: the feed's streams and index (``policies.event_feed``), or where the workers come from
(``router.discovery``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from tensorcast.policies import EventFeed

__all__ = ["EventThread"]

log = logging.getLogger("tensorcast.router")


class EventThread:
    """``start()``, then ``follow(workers)`` as often as the router reads them; ``stop()`` joins the thread and
    closes the feed's streams (their sockets belong to the thread while it runs)."""

    def __init__(self, feed: EventFeed, wait_s: float = 0.05) -> None:
        self.feed = feed
        self.wait_s = wait_s
        self._handed: tuple[list[Any], str | None] | None = None  # (workers, host id): from follow(), taken here
        self._handover = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tensorcast-router-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def follow(self, workers: Sequence[Any], host_id: str | None = None) -> None:
        """The pool's workers now: the thread follows their shard homes' streams from its next turn (those this
        host, ``host_id``, can reach: ``EventFeed.follow_workers``)."""
        with self._handover:
            self._handed = list(workers), host_id

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                with self._handover:
                    handed, self._handed = self._handed, None
                try:
                    if handed is not None:
                        self.feed.follow_workers(*handed)
                    if not self.feed.streams():
                        self._stop.wait(self.wait_s)  # nothing to follow yet
                    else:
                        self.feed.pump(self.wait_s)
                except Exception:  # a stream's failure must not end routing by events for good
                    log.exception("following the KV event streams failed; going on")
                    self._stop.wait(1.0)
        finally:
            self.feed.close()  # the streams' sockets are this thread's: closed here, whenever it ends

    def stop(self, timeout: float = 10.0) -> None:
        """Ends the thread (at its next turn: a wait on the network, a replay's at most 2 s per new stream), which
        closes the streams; waits for it ``timeout`` at most."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        elif self._thread.ident is None:  # never started: the streams are closed here
            self.feed.close()
