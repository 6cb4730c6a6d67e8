"""Routers: which engine instance serves a request, decided from recorded load signals.

Owns: the load metric (``load``), the request record a router sees (``Request``) and three routers —
``PowerOfTwo`` (two random choices), ``CacheAware`` (SGLang model gateway's ``cache_aware`` policy) and
``LoadAwareShared`` (least loaded; every instance fetches prefixes from the shared store). Every decision is
a method over a sequence of ``InstanceInfo`` (what ``Client.list_instances()`` returns) and the request: no
sockets, files or clocks; a router's only state is what it learned from earlier decisions (a seeded random
generator, a prefix index).

Does not own: sticky sessions (``policies.sessions`` wraps any router), moving sessions (``policies.rebalancer``
decides, ``policies.moves`` executes), or fetching the signals (the caller polls ``list_instances()``).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from tensorcast.errors import InvalidArgument, Unavailable
from tensorcast.policies.prefix_index import PrefixIndex, Tokens
from tensorcast.records import InstanceInfo

__all__ = ["CacheAware", "LoadAwareShared", "PowerOfTwo", "Request", "Router", "least_loaded", "live", "load"]


def load(info: InstanceInfo) -> int:
    """The load metric every policy here uses: requests the instance is running plus requests queued on it.

    It is what SGLang's gateway balances (requests in flight per worker), it is in every instance heartbeat,
    and it moves as soon as a request arrives or leaves — KV occupancy (``kv_tokens_used``) lags and counts
    idle sessions' caches, so it only breaks ties."""
    return info.running + info.waiting


def live(instances: Sequence[InstanceInfo]) -> list[InstanceInfo]:
    """The instances that are alive, in the given order; ``Unavailable`` when there are none."""
    out = [i for i in instances if i.alive]
    if not out:
        raise Unavailable("no live instance to route to")
    return out


def least_loaded(instances: Sequence[InstanceInfo]) -> InstanceInfo:
    """Lowest ``load``; ties go to the one using fewer KV tokens, then to the first in the given order."""
    return min(instances, key=lambda i: (load(i), i.kv_tokens_used))


@dataclass(frozen=True, eq=False)
class Request:
    """What a router sees of a request: its session (``""``: none) and its prompt's token ids."""

    session_id: str = ""
    prompt: Tokens = ()


class Router(abc.ABC):
    """A routing policy. ``choose`` is the decision (no side effects beyond a seeded generator's draw);
    ``observe`` records that a request went to an instance (a cache-aware router learns prefixes from it);
    ``route`` is both."""

    @abc.abstractmethod
    def choose(self, request: Request, instances: Sequence[InstanceInfo]) -> str: ...

    def observe(self, request: Request, instance_id: str) -> None:
        """Nothing to learn by default."""
        return None

    def route(self, request: Request, instances: Sequence[InstanceInfo]) -> str:
        chosen = self.choose(request, instances)
        self.observe(request, chosen)
        return chosen

    def set_topology(self, workers: Sequence[Any]) -> None:
        """The pool's workers (``WorkerInfo``s: ``list_workers()``), each time a router reads them: which worker
        is on which host, with which roles. Nothing to learn by default (``EventCacheAware`` credits an instance
        with what a shard home on its host holds)."""
        return None


class LoadAwareShared(Router):
    """Least loaded instance, always. With a shared KV store behind every instance, any instance can fetch
    a request's cached prefix, so the router keeps no affinity and only balances load."""

    def choose(self, request: Request, instances: Sequence[InstanceInfo]) -> str:
        return least_loaded(live(instances)).instance_id


class PowerOfTwo(Router):
    """Two distinct live instances drawn at random (seeded), the less loaded of the two (the first drawn on
    a tie): near-least-loaded balance without herding every request onto one instance between two polls of
    stale signals."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)

    def choose(self, request: Request, instances: Sequence[InstanceInfo]) -> str:
        candidates = live(instances)
        if len(candidates) == 1:
            return candidates[0].instance_id
        a, b = (candidates[int(k)] for k in self.rng.choice(len(candidates), size=2, replace=False))
        return (b if load(b) < load(a) else a).instance_id


class CacheAware(Router):
    """SGLang model gateway's ``cache_aware`` policy over an approximate per-instance prefix index.

    If load is imbalanced — ``max - min > balance_abs`` and ``max > min * balance_rel`` over live instances —
    the least loaded instance. Otherwise the instance whose index matches the longest prefix of the prompt,
    if ``matched / len(prompt) > cache_threshold`` (ties: the less loaded). Otherwise (``miss``) the least
    loaded instance, or, with ``miss="smallest_index"``, the one with the fewest indexed blocks, which is
    what the gateway itself does. Every routed prompt is added to its instance's index, balanced or not.

    The defaults ``cache_threshold=0.3``, ``balance_abs=64``, ``balance_rel=1.5`` are the gateway's published
    defaults (``--cache-threshold``, ``--balance-abs-threshold``, ``--balance-rel-threshold``). The gateway
    indexes characters of the request text with at most 2**26 nodes per tree; this index holds token blocks
    of ``block_size`` (match lengths are whole blocks) and at most ``max_blocks`` blocks per instance."""

    def __init__(self, cache_threshold: float = 0.3, balance_abs: int = 64, balance_rel: float = 1.5, *,
                 block_size: int = 16, max_blocks: int = 1 << 20,
                 miss: Literal["least_loaded", "smallest_index"] = "least_loaded") -> None:
        if not 0.0 <= cache_threshold <= 1.0:
            raise InvalidArgument(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_abs < 0 or balance_rel < 0:
            raise InvalidArgument(f"balance thresholds must be >= 0, got {balance_abs}, {balance_rel}")
        if miss not in ("least_loaded", "smallest_index"):
            raise InvalidArgument(f"miss must be 'least_loaded' or 'smallest_index', got {miss!r}")
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.miss = miss
        self.index = PrefixIndex(block_size, max_blocks)

    def imbalanced(self, instances: Sequence[InstanceInfo]) -> bool:
        loads = [load(i) for i in instances]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs and hi > lo * self.balance_rel

    def choose(self, request: Request, instances: Sequence[InstanceInfo]) -> str:
        return self._decide(self.index.keys(request.prompt), len(request.prompt), live(instances))

    def observe(self, request: Request, instance_id: str) -> None:
        self.index.insert(instance_id, self.index.keys(request.prompt))

    def route(self, request: Request, instances: Sequence[InstanceInfo]) -> str:
        keys = self.index.keys(request.prompt)  # hashed once for the decision and the index update
        chosen = self._decide(keys, len(request.prompt), live(instances))
        self.index.insert(chosen, keys)
        return chosen

    def matched(self, keys: Sequence[int], candidates: Sequence[InstanceInfo]) -> dict[str, int]:
        """Leading prompt tokens each candidate is believed to hold (here: what was routed to it)."""
        return self.index.longest_match(keys, (i.instance_id for i in candidates))

    def _decide(self, keys: Sequence[int], prompt_len: int, candidates: list[InstanceInfo]) -> str:
        if self.imbalanced(candidates):
            return least_loaded(candidates).instance_id
        matched = self.matched(keys, candidates)
        best = max(candidates, key=lambda i: (matched[i.instance_id], -load(i), -i.kv_tokens_used))
        if prompt_len and matched[best.instance_id] / prompt_len > self.cache_threshold:
            return best.instance_id
        if self.miss == "smallest_index":
            return min(candidates, key=lambda i: (self.index.size(i.instance_id), load(i))).instance_id
        return least_loaded(candidates).instance_id
