"""``EventFeed``: subscribes an ``EventIndex`` to the KV event streams of the pool's shard homes and of engines.

Owns the I/O around the pure index: one ``kv.event_stream.EventSubscriber`` per stream (a shard home's, found
in ``list_workers()`` as ``kv_events_url``; an engine's, given: vLLM's ``kv_events_config`` endpoint), a
replay from the start of each stream when it is first followed (what the publisher still buffers), and the
lifecycle a router needs: ``follow_workers`` subscribes to new homes and forgets those that died or restarted
(their pages are gone; a restarted home's first batch also says so). ``pump`` applies what arrived. Every change
to the index is made under ``lock``: a router that follows the streams on a thread of its own (their waits and
replays are network round trips) takes the same lock around its decisions, which read the index.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from tensorcast.kv_event_stream import EventSubscriber
from tensorcast.policies.event_router import instance_source, worker_source
from tensorcast.policies.kv_event_index import EventIndex

__all__ = ["EventFeed", "local_only"]

log = logging.getLogger("tensorcast.policies")


def local_only(endpoint: str) -> bool:
    """Whether a ZeroMQ endpoint names a socket of the host it was bound on only (``ipc://``, ``inproc://``, a
    loopback address)."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host == "::1" or host.startswith("127.")


class EventFeed:
    def __init__(self, index: EventIndex, *, topic: str = "") -> None:
        self.index = index
        self.topic = topic
        self.lock = threading.Lock()  # held while the index changes
        self._subs: dict[str, tuple[str, EventSubscriber]] = {}  # source -> (endpoint, subscriber)
        self._failing: set[str] = set()  # homes whose stream could not be followed (logged once)

    def streams(self) -> list[str]:
        """The sources whose streams are followed (``"instance:ID"``, ``"worker:ID"``)."""
        return list(self._subs)

    def add(self, source: str, endpoint: str, replay_endpoint: str | None = None, *, topic: str | None = None,
            replay: bool = True) -> None:
        """Follow one stream as ``source`` (replacing an earlier stream of that source)."""
        self.remove(source)
        sub = EventSubscriber(endpoint, topic=self.topic if topic is None else topic,
                              replay_endpoint=replay_endpoint or None)
        self._subs[source] = (endpoint, sub)
        if replay and replay_endpoint:
            for seq, batch in sub.replay(0, 2.0):
                with self.lock:
                    self.index.apply(source, batch)
                sub.next_seq = seq + 1

    def add_instance(self, instance_id: str, endpoint: str, replay_endpoint: str | None = None) -> None:
        """An engine's own stream (vLLM publishes with topic ``""`` unless configured otherwise)."""
        self.add(instance_source(instance_id), endpoint, replay_endpoint, topic="")

    def remove(self, source: str) -> None:
        old = self._subs.pop(source, None)
        if old is not None:
            old[1].close()
        with self.lock:
            self.index.forget(source)

    def follow_workers(self, workers: list[Any], host_id: str | None = None) -> None:
        """Follow every live shard home's stream (``WorkerInfo``s); forget homes that died or moved. With
        ``host_id`` (this process's host), a home on another host whose stream is bound to its own loopback or
        an ``ipc://`` path (``kv.events_allow_remote`` off, the default) is not followed: that address would
        name a socket of this host. A home that cannot be followed is logged (once) and tried again at the
        next call; the others are followed all the same."""
        live = {worker_source(w.worker_id): w for w in workers if w.alive and w.kv_events_url
                and (host_id is None or w.host_id == host_id or not local_only(w.kv_events_url))}
        for source in [s for s in self._subs if s.startswith("worker:") and
                       (s not in live or self._subs[s][0] != live[s].kv_events_url)]:
            self.remove(source)
        for source, w in live.items():
            if source in self._subs:
                continue
            try:
                self.add(source, w.kv_events_url, w.kv_events_replay_url)
                self._failing.discard(source)
            except Exception as exc:  # one home's stream (a refused endpoint, a bad replay) stops no other
                self.remove(source)
                (log.debug if source in self._failing else log.warning)(
                    "cannot follow the KV events of %s at %s: %s", source, w.kv_events_url, exc)
                self._failing.add(source)

    def pump(self, timeout: float = 0.0) -> int:
        """Apply the batches that arrived (waiting at most ``timeout`` for the first); returns how many."""
        n = 0
        deadline = time.monotonic() + timeout
        for source, (_, sub) in list(self._subs.items()):
            for _, batch in sub.poll(max(0.0, deadline - time.monotonic()) if n == 0 else 0.0):
                with self.lock:
                    self.index.apply(source, batch)
                n += 1
        return n

    def close(self) -> None:
        for source in list(self._subs):
            self.remove(source)
