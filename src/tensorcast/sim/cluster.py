"""The simulated cluster as a policy sees it: ``list_instances()`` signals and one-step session moves.

Owns: ``SimCluster`` — the simulated instances (``sim.engine``), the shared store when the experiment has
one, the signals the real client returns (``list_instances()``: ``tensorcast.records.InstanceInfo``, exact and
current: no heartbeat lag) and the execution of a rebalancer's ``Move``: publish the session's KV on the
source, prefetch it to the target's worker, hydrate it into the target (``CostModel.move_s``: three copies,
I/O that does not slow either engine's iterations), after which the session's blocks are cached on the
target, published to the store if there is one, and the caller reroutes the session — what
``tensorcast.policies.MoveSession`` does with one plan on a live cluster. The source keeps its copy (a
publish copies; LRU eviction reclaims it later), also as on a live cluster.

It also tells each instance how many others are busy (``SimInstance.busy_others``), for the cost model's
contention term: instances that share CPUs slow each other down.

Does not own: deciding (the policy classes, run unchanged), sessions and turns (``sim.run``) or costs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from tensorcast.errors import InvalidArgument, NotFound
from tensorcast.policies.rebalancer import Move
from tensorcast.records import InstanceInfo
from tensorcast.sim.engine import EventLoop, SimConfig, SimInstance, SimRequest
from tensorcast.sim.kvcache import SharedStore, salt_keys
from tensorcast.sim.metrics import MoveRecord

__all__ = ["SimCluster"]


class SimCluster:
    """``config.instances`` simulated engines named ``instance-0`` ..., sharing ``store`` when
    ``shared_kv`` (every instance can load any published block) and otherwise each on its own."""

    def __init__(self, loop: EventLoop, config: SimConfig, shared_kv: bool) -> None:
        self.loop, self.config = loop, config
        self.store = SharedStore() if shared_kv else None
        self.instances = {f"instance-{k}": SimInstance(f"instance-{k}", loop, config, self.store)
                          for k in range(config.instances)}
        for name, inst in self.instances.items():
            inst.busy_others = functools.partial(self._busy_others, name)

    def _busy_others(self, instance_id: str) -> float:
        """Instances other than ``instance_id`` in the middle of an iteration (they contend for the CPUs)."""
        return float(sum(inst.stepping for name, inst in self.instances.items() if name != instance_id))

    def list_instances(self) -> list[InstanceInfo]:
        """Every instance's signals now, as ``Client.list_instances()`` returns them."""
        return [inst.info() for inst in self.instances.values()]

    def instance(self, instance_id: str) -> SimInstance:
        try:
            return self.instances[instance_id]
        except KeyError:
            raise NotFound(f"no simulated instance {instance_id!r}") from None

    def submit(self, instance_id: str, request: SimRequest) -> None:
        self.instance(instance_id).submit(request)

    def move(self, move: Move, keys: Sequence[int], on_done: Callable[[MoveRecord], None], salt: int = 0) -> None:
        """Start ``move`` (``keys``: the session's blocks, its ``move.kv_tokens`` of KV; the target's cache names
        them with ``salt``, ``kvcache.salt_keys``); ``on_done`` runs when the KV is on the target. The caller
        keeps the session from starting a turn until then."""
        if move.source == move.target:
            raise InvalidArgument(f"move of {move.session_id!r} has the same source and target")
        self.instance(move.source)
        target = self.instance(move.target)
        start = self.loop.now
        record = MoveRecord(move.session_id, move.source, move.target, move.kv_tokens,
                            self.config.cost.kv_bytes(move.kv_tokens), start,
                            start + self.config.cost.move_s(move.kv_tokens))

        def hydrated() -> None:
            target.cache.insert(salt_keys(keys, salt))
            if self.store is not None:
                self.store.publish(keys)
            on_done(record)

        self.loop.at(record.done_s, hydrated)
