"""The router credits a backend with the KV pages the pool holds on its host (real processes).

A cluster of two workers on two hosts, each a shard home publishing its pages' KV events; two engine servers,
each announced through the worker of its host. ``event-cache-aware`` in the router service reads each
backend's home worker and the shard homes from the cluster, and follows the homes' streams: a prompt whose
prefix only the pool holds, on the second host, goes to the backend on that host, and back to the least loaded
once the page's lease ends.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("zmq")

import tensorcast as tc  # noqa: E402
from tensorcast.instance.announce import Announcement  # noqa: E402
from tensorcast.kv.keys import shard_of  # noqa: E402
from tensorcast.kv_event_stream import EventPublisher  # noqa: E402
from tensorcast.kv_events import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402
from tensorcast.policies import EventFeed, EventIndex, Request, block_keys  # noqa: E402
from tensorcast.records import InstanceInfo, WorkerInfo  # noqa: E402
from tensorcast.router import RouterService  # noqa: E402
from tensorcast.router.choice import as_instances, make_event_policy  # noqa: E402
from tensorcast.router.discovery import Discovery  # noqa: E402
from tensorcast.testing import running_cluster  # noqa: E402
from tensorcast.testing.cluster import wait_shards_settled  # noqa: E402

from .conftest import Backend, complete, run, running  # noqa: E402

BEAT = 0.2
LIVENESS = 3.0
CONFIG = {"kv.lease_ttl": 1.0, "kv.renew_interval": 0.25, "kv.events_endpoint": "tcp://127.0.0.1:0",
          "kv.events_replay_endpoint": "tcp://127.0.0.1:0", "kv.memory_capacity": 64 * 4096,
          "kv.arena_bytes": 1 << 20, "kv.max_page_bytes": 65536, "gs.worker_liveness_timeout": LIVENESS}
BLOCK = 4
PAGE_TTL = 6.0  # long enough to see the page credited, short enough to see it go
TOKENS = [11, 12, 13, 14]  # one block


def _page_homed_on(home: str, shards: dict[int, tuple[str, int]]) -> tuple[bytes, str]:
    """A block hash whose page key (vLLM's tier namespace: the pool's events name the hash) is in a shard
    ``home`` holds."""
    for i in range(10_000):
        block_hash = i.to_bytes(32, "big")
        key = f"vb/{'0' * 16}/{block_hash.hex()}/g0"
        if shards[shard_of(key, len(shards))][0] == home:
            return block_hash, key
    raise AssertionError(f"no page key homed on {home}")


async def _until(what: str, done: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(BEAT / 2)


def test_a_prefix_only_the_pool_holds_goes_to_the_backend_on_its_host() -> None:
    with running_cluster(workers=2, hosts=2, config=CONFIG) as cluster, tc.connect(cluster.address) as c:
        w0, w1 = cluster.worker_ids
        shards = wait_shards_settled(c, {w0, w1})
        block_hash, key = _page_homed_on(w1, shards)
        engine = EventPublisher("tcp://127.0.0.1:0")  # b0's engine: its own events name the block's tokens

        async def scenario() -> None:
            b0, b1 = Backend("b0"), Backend("b1")
            await b0.start()
            await b1.start()
            announced = [Announcement(cluster.workers[w].address, b.url, engine="vllm", interval=BEAT)
                         for w, b in ((w0, b0), (w1, b1))]
            policy, index = make_event_policy(BLOCK, sessions="off")
            feed = EventFeed(index, topic="tensorcast")
            feed.add_instance("b0", engine.endpoint)
            # The router runs on the second host: the first's home streams on its own loopback, out of reach.
            service = RouterService([b0.url, b1.url], policy, feed=feed, health_interval=BEAT,
                                    discovery=Discovery(cluster.address, adds_backends=False,
                                                        host_id=cluster.host_id_of(1)))
            await service.start()
            view = Request("", (*TOKENS, 7, 8))
            body = {"prompt": list(view.prompt), "max_tokens": 1}
            try:
                await _until("each backend's home worker read from its record",
                             lambda: [b.home_worker for b in service.backends] == [w0, w1], LIVENESS)
                stored = BlockStored(block_hashes=[block_hash], parent_block_hash=None, token_ids=TOKENS,
                                     block_size=BLOCK, lora_id=None, medium="GPU", lora_name=None)

                def b0_holds() -> int:  # the router's event thread changes the index under the feed's lock
                    with feed.lock:
                        return index.matched_tokens("instance:b0", block_keys(view.prompt, BLOCK))

                def publish_until_held() -> bool:
                    engine.publish(KVEventBatch(ts=0.0, events=[stored]))  # until its subscriber has joined
                    return b0_holds() == BLOCK

                await _until("b0's engine events reach the router", publish_until_held, 10)
                engine.publish(KVEventBatch(ts=1.0, events=[BlockRemoved(block_hashes=[block_hash], medium="GPU")]))
                await _until("b0's eviction reaches the router", lambda: b0_holds() == 0, 10)
                assert (await complete(session, service, body))["backend"] == "b0"  # held nowhere: least loaded

                c.kv.put([key], [np.full(4096, 1, np.uint8)], ttl=PAGE_TTL)  # in the pool, on w1's host

                def matched() -> dict[str, int]:
                    with feed.lock:
                        return policy.matched_tokens(view, as_instances(service.backends))  # type: ignore[attr-defined,no-any-return]

                await _until("the shard home's event reaches the router", lambda: matched()["b1"] == BLOCK, 10)
                assert feed.streams() == ["instance:b0", f"worker:{w1}"]
                assert matched()["b0"] == 0
                assert [(await complete(session, service, body))["backend"] for _ in range(3)] == ["b1"] * 3

                # Its lease ends: the home frees it, and nobody holds the prefix any more.
                await _until("the home's removal reaches the router", lambda: matched()["b1"] == 0, PAGE_TTL + 10)
                assert (await complete(session, service, body))["backend"] == "b0"
            finally:
                await service.stop()
                for a in announced:
                    a.stop()
                await b0.stop()
                await b1.stop()

        async def with_session() -> None:
            nonlocal session
            async with aiohttp.ClientSession() as session:
                await scenario()

        session: Any = None
        try:
            run(with_session)
        finally:
            engine.close()


class _SilentHome(Discovery):
    """A cluster listing one shard home whose replay endpoint takes requests and never answers."""

    def __init__(self, replay_url: str) -> None:
        super().__init__("unused:1", adds_backends=False)
        self.replay_url = replay_url
        self.asked = 0

    async def survey(self) -> tuple[list[InstanceInfo], list[WorkerInfo]]:
        self.asked += 1
        home = WorkerInfo(worker_id=f"w{self.asked}", address="127.0.0.1:1", host_id=self.host_id,
                          roles=("shard-home",), kv_events_url="tcp://127.0.0.1:1",
                          kv_events_replay_url=self.replay_url)
        return [], [home]  # a new home every time: a replay to wait for at every survey


def test_a_home_that_never_answers_its_replay_holds_up_no_request() -> None:
    """Following a stream waits on the network (a new home's replay: up to 2 s); the router's requests meanwhile
    are routed as fast as ever: the streams are followed on a thread of their own."""
    import zmq

    silent = zmq.Context.instance().socket(zmq.ROUTER)  # takes the replay request, answers nothing
    port = silent.bind_to_random_port("tcp://127.0.0.1")

    async def scenario() -> None:
        policy, index = make_event_policy(BLOCK, sessions="off")
        discovery = _SilentHome(f"tcp://127.0.0.1:{port}")
        async with running(policy, feed=EventFeed(index, topic="tensorcast"), discovery=discovery,
                           health_interval=BEAT) as (service, _backends, session):
            await _until("a home followed", lambda: discovery.asked >= 2, 10)
            slowest, surveys = 0.0, discovery.asked
            while discovery.asked < surveys + 2:  # requests all along two more surveys (each: a new home)
                t0 = time.monotonic()
                await complete(session, service, {"prompt": [1, 2, 3]})
                slowest = max(slowest, time.monotonic() - t0)
            assert silent.poll(0), "no replay was asked for"
            assert slowest < 1.0, f"a request took {slowest:.2f} s while a replay went unanswered"

    try:
        run(scenario)
    finally:
        silent.close()


def test_a_home_is_followed_where_this_host_can_reach_it_and_one_failing_stops_no_other() -> None:
    def home(worker_id: str, host_id: str, url: str) -> WorkerInfo:
        return WorkerInfo(worker_id=worker_id, address="127.0.0.1:1", host_id=host_id, roles=("shard-home",),
                          kv_events_url=url)

    feed = EventFeed(EventIndex(BLOCK), topic="tensorcast")
    try:
        feed.follow_workers([home("bad", "here", "tcp://no-port"),  # refused by ZeroMQ: logged, the rest go on
                             home("w0", "here", "tcp://127.0.0.1:9"), home("w1", "there", "tcp://127.0.0.1:9"),
                             home("w2", "there", "ipc:///tmp/tensorcast-events"),
                             home("w3", "there", "tcp://10.1.2.3:9")], host_id="here")
        assert feed.streams() == ["worker:w0", "worker:w3"]  # another host's loopback and ipc: not this host's
    finally:
        feed.close()
