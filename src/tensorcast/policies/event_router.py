"""``EventCacheAware``: the cache-aware router fed by what engines and the pool say they hold (KV events).

The decision is ``CacheAware``'s (SGLang model gateway's ``cache_aware``: balance first when load is uneven,
else the longest cached prefix above ``cache_threshold``, else the least loaded), but "cached" is no longer
a guess from routing history: an instance holds a prefix when its own KV events say so (``"instance:ID"``:
its GPU cache, its connector's saves), or when a shard home on its host holds it in the pool
(``"worker:ID"``; a same-host page is a memory copy away). ``kv_event_index.EventIndex`` keeps that state;
``event_feed.EventFeed`` subscribes to the streams. Pure: no sockets or clocks here; the topology (which
worker is on which host, from ``list_workers()``) is handed in with ``set_topology``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from tensorcast.policies.kv_event_index import EventIndex
from tensorcast.policies.routers import CacheAware, Request, live
from tensorcast.records import InstanceInfo

__all__ = ["EventCacheAware", "instance_source", "worker_source"]


def instance_source(instance_id: str) -> str:
    return f"instance:{instance_id}"


def worker_source(worker_id: str) -> str:
    return f"worker:{worker_id}"


class EventCacheAware(CacheAware):
    def __init__(self, index: EventIndex, cache_threshold: float = 0.3, balance_abs: int = 64,
                 balance_rel: float = 1.5, *, miss: Literal["least_loaded", "smallest_index"] = "least_loaded",
                 same_host_pool: bool = True) -> None:
        super().__init__(cache_threshold, balance_abs, balance_rel, block_size=index.block_size, max_blocks=1,
                         miss=miss)
        self.events = index
        self.same_host_pool = same_host_pool
        self._host_of: dict[str, str] = {}  # worker id -> host id
        self._homes_on: dict[str, list[str]] = {}  # host id -> sources of its shard homes

    def set_topology(self, workers: Sequence[Any]) -> None:
        """Which worker is on which host (``WorkerInfo``s: ``list_workers()``)."""
        self._host_of = {w.worker_id: w.host_id for w in workers}
        self._homes_on = {}
        for w in workers:
            if w.alive and "shard-home" in w.roles:
                self._homes_on.setdefault(w.host_id, []).append(worker_source(w.worker_id))

    def matched(self, keys: Sequence[int], candidates: Sequence[InstanceInfo]) -> dict[str, int]:
        out = {}
        for i in candidates:
            own = self.events.matched_tokens(instance_source(i.instance_id), keys)
            pool = 0
            if self.same_host_pool:
                host = self._host_of.get(i.home_worker)
                pool = self.events.best_of(self._homes_on.get(host, ()) if host is not None else (), keys)
            out[i.instance_id] = max(own, pool)
        return out

    def observe(self, request: Request, instance_id: str) -> None:
        return None  # it learns from the events, never from its own guesses

    def route(self, request: Request, instances: Sequence[InstanceInfo]) -> str:
        return self.choose(request, instances)

    def matched_tokens(self, request: Request, instances: Sequence[InstanceInfo]) -> dict[str, int]:
        """What the decision saw: leading prompt tokens each live instance holds (its own or its host's)."""
        return self.matched(self.index.keys(request.prompt), live(instances))
