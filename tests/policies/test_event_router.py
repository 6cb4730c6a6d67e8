"""The events-fed cache-aware router on plain event batches (no engines, no sockets): chains rebuilt from
vLLM's ``BlockStored`` tokens and parent hashes, the pool's token-less events matched through the same hashes,
removals, restarts, bounds, and the routing decisions they lead to."""

from __future__ import annotations

import hashlib

import pytest

from tensorcast.errors import InvalidArgument
from tensorcast.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from tensorcast.policies.event_router import EventCacheAware, instance_source, worker_source
from tensorcast.policies.kv_event_index import EventIndex
from tensorcast.policies.prefix_index import block_keys
from tensorcast.policies.routers import Request
from tensorcast.records import InstanceInfo, WorkerInfo

B = 4  # tokens per block


def h(*path: int) -> bytes:
    return hashlib.sha256(repr(path).encode()).digest()


def stored(hashes: list[bytes], tokens: list[int] | None, parent: bytes | None = None,
           medium: str = "GPU") -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=[BlockStored(
        block_hashes=list(hashes), parent_block_hash=parent, token_ids=tokens or [],
        block_size=B if tokens else 0, lora_id=None, medium=medium, lora_name=None)])


PROMPT = [*range(100, 100 + 4 * B), 1, 2]  # 4 full blocks and a partial one
KEYS = block_keys(PROMPT, B)


def test_chains_from_tokens_and_parents_and_pool_events_through_the_same_hashes() -> None:
    idx = EventIndex(B)
    # An engine announces blocks 0-1, then 2-3 in a later batch (parent: block 1's hash).
    idx.apply("instance:a", stored([h(0), h(1)], PROMPT[:2 * B]))
    idx.apply("instance:a", stored([h(2), h(3)], PROMPT[2 * B:4 * B], parent=h(1)))
    assert idx.matched_tokens("instance:a", KEYS) == 4 * B
    assert idx.matched_tokens("instance:a", block_keys([9] * 8 + PROMPT, B)) == 0  # another prefix
    # A shard home announces blocks 0-2 with no tokens: matched through the hashes the engine named.
    idx.apply("worker:w1", stored([h(0), h(1), h(2)], None, medium="CPU"))
    assert idx.matched_tokens("worker:w1", KEYS) == 3 * B
    idx.apply("worker:w1", KVEventBatch(ts=1.0, events=[BlockRemoved(block_hashes=[h(1)], medium="CPU")]))
    assert idx.matched_tokens("worker:w1", KEYS) == 1 * B  # a gap ends the prefix
    idx.apply("instance:a", KVEventBatch(ts=2.0, events=[AllBlocksCleared()]))
    assert idx.matched_tokens("instance:a", KEYS) == 0
    idx.forget("worker:w1")
    assert idx.sources() == []


def test_a_block_whose_parent_was_never_seen_is_not_guessed() -> None:
    idx = EventIndex(B)
    idx.apply("instance:a", stored([h(2)], PROMPT[2 * B:3 * B], parent=h(1)))
    assert idx.unchained == 1 and idx.matched_tokens("instance:a", KEYS) == 0
    # Another block size, or tokens not matching the hashes, teach nothing either.
    idx.apply("instance:a", stored([h(0)], PROMPT[:B - 1]))
    assert idx.matched_tokens("instance:a", KEYS) == 0
    with pytest.raises(InvalidArgument):
        EventIndex(0)


def test_translations_are_bounded() -> None:
    idx = EventIndex(B, max_blocks=2)
    idx.apply("instance:a", stored([h(0), h(1), h(2)], PROMPT[:3 * B]))
    assert idx.matched_tokens("instance:a", KEYS) == 0  # block 0's translation went first
    assert len(idx._key_of) == 2


def _world() -> tuple[list[WorkerInfo], list[InstanceInfo]]:
    workers = [WorkerInfo(worker_id=f"w{i}", address=f"127.0.0.1:{i}", host_id=f"host-{i}",
                          roles=("basic", "shard-home")) for i in range(2)]
    instances = [InstanceInfo(instance_id=x, address="", home_worker=f"w{i}") for i, x in enumerate("ab")]
    return workers, instances


def test_routes_to_the_instance_holding_the_prefix_or_whose_host_does() -> None:
    workers, instances = _world()
    idx = EventIndex(B)
    router = EventCacheAware(idx)
    router.set_topology(workers)
    req = Request(prompt=PROMPT)
    assert router.route(req, instances) == "a"  # nothing known: least loaded, first on a tie
    idx.apply(instance_source("b"), stored([h(0), h(1), h(2)], PROMPT[:3 * B]))
    assert router.route(req, instances) == "b"
    assert router.matched_tokens(req, instances) == {"a": 0, "b": 3 * B}
    # b forgot it; the pool on a's host holds it: a is as good as holding it itself.
    idx.apply(instance_source("b"), KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
    idx.apply(worker_source("w0"), stored([h(0), h(1), h(2)], None, medium="CPU"))
    assert router.route(req, instances) == "a"
    # Uneven load wins over the cache.
    busy = [InstanceInfo(instance_id="a", address="", home_worker="w0", running=200),
            InstanceInfo(instance_id="b", address="", home_worker="w1")]
    assert router.route(req, busy) == "b"
    # The pool counts only where it is on the instance's host.
    off = EventCacheAware(idx, same_host_pool=False)
    off.set_topology(workers)
    assert off.matched_tokens(req, instances) == {"a": 0, "b": 0}
