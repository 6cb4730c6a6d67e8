"""KV events in vLLM's format: what a page store reports, the ZeroMQ stream (replay, hostile peers), and a
real cluster whose shard homes tell a subscriber of pages stored, expired, evicted and of a restarted home."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import pytest

import tensorcast as tc
from tensorcast.errors import InvalidArgument
from tensorcast.kv.events import PageEvents
from tensorcast.kv.pages import PageStore
from tensorcast.kv_event_stream import EventPublisher, EventSubscriber, check_endpoint
from tensorcast.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    block_hash_of,
    decode_batch,
    encode_batch,
)
from tensorcast.testing import running_cluster, wait_shards_settled

zmq = pytest.importorskip("zmq", reason="KV events need pyzmq (the events extra; in the dev extra)")

VKEY = "vb/0123456789abcdef/" + "ab" * 32 + "/g1"


def test_block_hash_of_vllm_keys_and_others() -> None:
    assert block_hash_of(VKEY) == (bytes.fromhex("ab" * 32), 1)
    assert block_hash_of(VKEY + "/p2") == (bytes.fromhex("ab" * 32), 1)  # a part of a large chunk
    assert block_hash_of("some/other-key") == (b"some/other-key", None)
    assert block_hash_of("vb/0123456789abcdef/abc/g1") == (b"vb/0123456789abcdef/abc/g1", None)  # odd hex


def _events() -> tuple[PageEvents, list[KVEventBatch], list[Callable[[], None]]]:
    batches: list[KVEventBatch] = []
    scheduled: list[Callable[[], None]] = []
    return PageEvents(batches.append, scheduled.append, clock=lambda: 12.5), batches, scheduled


def test_page_events_one_batch_per_turn_runs_by_kind_and_group() -> None:
    ev, batches, scheduled = _events()
    ev.stored("a")
    ev.stored("b")
    ev.stored(VKEY)
    ev.removed("a")
    assert len(scheduled) == 1 and not batches  # one flush scheduled for the turn
    scheduled.pop()()
    (batch,) = batches
    assert batch.ts == 12.5
    assert [type(e).__name__ for e in batch.events] == ["BlockStored", "BlockStored", "BlockRemoved"]
    first, second, third = batch.events
    assert isinstance(first, BlockStored) and first.block_hashes == [b"a", b"b"] and first.group_idx is None
    assert isinstance(second, BlockStored) and second.group_idx == 1 and second.medium == "CPU"
    assert second.ownership == "tensorcast"
    assert isinstance(third, BlockRemoved) and third.block_hashes == [b"a"]
    ev.cleared()
    assert isinstance(batches[-1].events[0], AllBlocksCleared)


def test_batches_roundtrip_and_garbage_is_a_typed_error() -> None:
    ev, batches, scheduled = _events()
    ev.stored(VKEY)
    scheduled.pop()()
    assert decode_batch(encode_batch(batches[0])) == batches[0]
    for junk in (b"", b"\x93\x01", msgspec.msgpack.encode([1.0, [{"type": "Nope"}]])):
        with pytest.raises(msgspec.MsgspecError):
            decode_batch(junk)


def test_page_store_reports_stores_overwrites_evictions_expiry_and_drops() -> None:
    store = PageStore(3 * 4096, "tc-test-events", arena_bytes=1 << 20, max_page_bytes=65536)
    seen: list[tuple[str, list[bytes]]] = []

    def publish(batch: KVEventBatch) -> None:
        for e in batch.events:
            if isinstance(e, BlockStored | BlockRemoved):
                seen.append((type(e).__name__, list(e.block_hashes)))

    store.events = PageEvents(publish, lambda f: None)
    try:
        def put(key: str, now: float, ttl: float | None = None, shard: int = 0) -> None:
            page, view = store.reserve(shard, key, 4096, now)
            view[:] = b"x" * 4096
            store.commit(key, page, ttl, now)

        put("k1", 0.0)
        put("k1", 0.0)  # stored again: no removal
        put("k2", 0.0, ttl=1.0)
        put("k3", 0.0, shard=1)
        put("k4", 0.5)  # full: k1, the least recently used, is evicted
        store.expire(2.0)  # k2's TTL
        store.drop_shard(1)  # k3
        store.drop_keys(["k4"])
        store.events.flush()
        assert seen == [("BlockStored", [b"k1", b"k1", b"k2", b"k3"]), ("BlockRemoved", [b"k1"]),
                        ("BlockStored", [b"k4"]), ("BlockRemoved", [b"k2", b"k3", b"k4"])]
    finally:
        store.close()


def test_check_endpoint() -> None:
    check_endpoint("tcp://127.0.0.1:0", False)
    check_endpoint("ipc:///tmp/x.sock", False)
    check_endpoint("tcp://*:5557", True)
    for bad in ("tcp://*:5557", "tcp://0.0.0.0:1", "tcp://10.0.0.1:5557"):
        with pytest.raises(InvalidArgument, match="unauthenticated"):
            check_endpoint(bad, False)
    for bad in ("udp://127.0.0.1:1", "tcp://127.0.0.1", "127.0.0.1:5", "tcp://:5", "ipc://"):
        with pytest.raises(InvalidArgument, match="expected"):
            check_endpoint(bad, True)


def test_a_taken_endpoint_is_a_typed_error() -> None:
    first = EventPublisher("tcp://127.0.0.1:0")
    try:
        with pytest.raises(InvalidArgument, match="cannot bind"):
            EventPublisher(first.endpoint)  # a second home on this host configured with the same port
    finally:
        first.close()


def _collect(sub: EventSubscriber, until: Callable[[list[KVEventBatch]], bool], timeout: float) -> list[KVEventBatch]:
    got: list[KVEventBatch] = []
    deadline = time.monotonic() + timeout
    while not until(got) and time.monotonic() < deadline:
        got += [b for _, b in sub.poll(0.1)]
    return got


def test_stream_replays_what_a_late_subscriber_missed_and_ignores_hostile_peers() -> None:
    pub = EventPublisher("tcp://127.0.0.1:0", topic="t", replay_endpoint="tcp://127.0.0.1:0", buffer_batches=100)
    assert pub.replay_endpoint is not None
    try:
        for i in range(5):  # nobody listening yet: a PUB socket drops these
            pub.publish(KVEventBatch(ts=float(i), events=[AllBlocksCleared()]))
        ctx = zmq.Context.instance()
        # Hostile peers on the replay socket: a huge frame, wrong frame counts, a short sequence number.
        for frames in ([b"", b"x" * 1_000_000], [b"", b"", b""], [b"", b"abc"], [b"x"]):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(pub.replay_endpoint)
            s.send_multipart(frames)
            s.close()
        # The publisher sends from its own thread: wait until the five are sent (and buffered for replay), so
        # that none reaches the subscriber below live (on a busy host the thread may not have run yet).
        probe = EventSubscriber(pub.endpoint, topic="none", replay_endpoint=pub.replay_endpoint)
        deadline = time.monotonic() + 10
        while len(probe.replay(0, 1.0)) < 5:
            assert time.monotonic() < deadline, "the publisher never sent its batches"
        probe.close()
        sub = EventSubscriber(pub.endpoint, topic="t", replay_endpoint=pub.replay_endpoint)
        try:
            time.sleep(0.2)  # the subscription reaches the publisher
            old = sub.replay(0, 5.0)
            assert [seq for seq, _ in old] == [0, 1, 2, 3, 4]
            assert [b.ts for _, b in old] == [0.0, 1.0, 2.0, 3.0, 4.0]
            pub.publish(KVEventBatch(ts=5.0, events=[]))
            got = _collect(sub, lambda g: len(g) >= 1, 5.0)
            assert [b.ts for b in got] == [5.0] and sub.next_seq == 6
        finally:
            sub.close()
    finally:
        pub.close()


def test_subscriber_skips_garbage_and_replays_a_gap() -> None:
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.PUB)  # a publisher that sends garbage and skips a sequence number
    raw.setsockopt(zmq.LINGER, 0)
    raw.bind("tcp://127.0.0.1:0")
    sub = EventSubscriber(raw.getsockopt_string(zmq.LAST_ENDPOINT))
    try:
        time.sleep(0.2)
        good = encode_batch(KVEventBatch(ts=1.0, events=[]))
        raw.send_multipart([b"", (0).to_bytes(8, "big"), good])
        raw.send_multipart([b"", (1).to_bytes(8, "big"), b"\xc1garbage"])
        raw.send_multipart([b"only-one-frame"])
        raw.send_multipart([b"", (3).to_bytes(8, "big"), good])
        got = _collect(sub, lambda g: len(g) >= 2, 5.0)
        assert len(got) == 2 and sub.malformed == 2
        assert sub.gaps == 2  # 1 was garbage and 2 never came; there is no replay endpoint to ask them of
    finally:
        sub.close()
        raw.close()


def test_a_subscriber_refuses_an_absurd_message_without_holding_it() -> None:
    from tensorcast.kv_event_stream import MAX_MESSAGE_BYTES

    ctx = zmq.Context.instance()
    hostile = ctx.socket(zmq.PUB)  # one message past the limit: cut off before it is buffered
    hostile.setsockopt(zmq.LINGER, 0)
    hostile.bind("tcp://127.0.0.1:0")
    honest = EventPublisher("tcp://127.0.0.1:0")
    bad = EventSubscriber(hostile.getsockopt_string(zmq.LAST_ENDPOINT))
    good = EventSubscriber(honest.endpoint)
    try:
        time.sleep(0.2)
        hostile.send_multipart([b"", (0).to_bytes(8, "big"), b"\0" * (MAX_MESSAGE_BYTES + 1)])
        assert list(bad.poll(1.0)) == [] and bad.malformed == 0  # nothing delivered, nothing raised
        honest.publish(KVEventBatch(ts=2.0, events=[]))  # the other streams of this process carry on
        got = _collect(good, lambda g: len(g) >= 1, 5.0)
        assert [b.ts for b in got] == [2.0]
    finally:
        bad.close()
        good.close()
        hostile.close()
        honest.close()


# ----------------------------------------------------------------- a real cluster
TTL, RENEW = 2.0, 0.5
CONFIG = {"kv.lease_ttl": TTL, "kv.renew_interval": RENEW, "kv.events_endpoint": "tcp://127.0.0.1:0",
          "kv.events_replay_endpoint": "tcp://127.0.0.1:0", "kv.memory_capacity": 64 * 4096,
          "kv.arena_bytes": 1 << 20, "kv.max_page_bytes": 65536}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with running_cluster(workers=2, config=CONFIG) as c:
        yield c


class Holdings:
    """What a router following every home's stream believes the pool holds: key bytes -> homes."""

    def __init__(self, client: Any) -> None:
        self.subs: dict[str, EventSubscriber] = {}
        self.held: dict[bytes, set[str]] = {}
        self.ever: set[bytes] = set()  # every block announced stored, gone since or not
        self.cleared: dict[str, int] = {}
        self.client = client

    def follow(self) -> None:
        for w in self.client.list_workers():
            if w.kv_events_url and w.alive and self.subs.get(w.worker_id, None) is None:
                self.subs[w.worker_id] = EventSubscriber(w.kv_events_url, topic="tensorcast",
                                                         replay_endpoint=w.kv_events_replay_url)

    def pump(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for wid, sub in self.subs.items():
                for _, batch in sub.poll(0.02):
                    for e in batch.events:
                        if isinstance(e, AllBlocksCleared):
                            self.cleared[wid] = self.cleared.get(wid, 0) + 1
                            for homes in self.held.values():
                                homes.discard(wid)
                        elif isinstance(e, BlockStored):
                            for h in e.block_hashes:
                                self.held.setdefault(bytes(h), set()).add(wid)
                                self.ever.add(bytes(h))
                        elif isinstance(e, BlockRemoved):
                            for h in e.block_hashes:
                                self.held.get(bytes(h), set()).discard(wid)

    def holds(self, key: str) -> bool:
        return bool(self.held.get(key.encode()))

    def close(self) -> None:
        for sub in self.subs.values():
            sub.close()


def _wait(cond: Callable[[], bool], h: Holdings, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        h.pump(0.1)
    return cond()


def test_homes_publish_stores_expiry_eviction_and_restart(cluster: Any) -> None:
    with tc.connect(cluster.address) as c:
        wait_shards_settled(c, set(cluster.worker_ids))
        workers = {w.worker_id: w for w in c.list_workers()}
        assert all(w.kv_events_url.startswith("tcp://127.0.0.1:") for w in workers.values())
        assert all(w.kv_events_replay_url.startswith("tcp://127.0.0.1:") for w in workers.values())
        h = Holdings(c)
        h.follow()
        try:
            h.pump(0.3)  # subscriptions reach the publishers
            keys = [f"ev-{i}" for i in range(16)]
            page = np.full(4096, 7, np.uint8)
            assert c.kv.put(keys, [page] * len(keys)) == len(keys)
            assert _wait(lambda: all(h.holds(k) for k in keys), h, 5.0)
            # TTL: gone within a renewal period of its expiry (homes expire pages on their lease loop).
            short = [f"ev-ttl-{i}" for i in range(4)]
            c.kv.put(short, [page] * 4, ttl=1.0)
            assert _wait(lambda: all(k.encode() in h.ever for k in short), h, 5.0)
            # The home's lease loop frees them within a tick (RENEW / 2) of the TTL; slack for a busy host.
            assert _wait(lambda: not any(h.holds(k) for k in short), h, 1.0 + 4 * RENEW + 5.0)
            # Eviction: 64 pages of capacity per home; 160 more pages push the first ones out.
            more = [f"ev-more-{i}" for i in range(160)]
            for i in range(0, len(more), 40):
                c.kv.put(more[i:i + 40], [page] * 40)
            h.pump(0.5)
            present = c.kv.present(keys + more)
            assert not all(present)  # some were evicted ...
            assert _wait(lambda: [h.holds(k) for k in keys + more] == c.kv.present(keys + more), h, 5.0)
            # A home restarted: its first batch clears what it said before it went (its pages are gone).
            victim = cluster.worker_ids[0]
            h.subs.pop(victim).close()
            cluster.kill_worker(victim)
            cluster.restart_worker(victim)
            wait_shards_settled(c, set(cluster.worker_ids))
            w = next(w for w in c.list_workers() if w.worker_id == victim and w.alive)
            sub = EventSubscriber(w.kv_events_url, topic="tensorcast", replay_endpoint=w.kv_events_replay_url)
            first = sub.replay(0, 5.0)  # it published before anyone could subscribe: a replay shows it
            assert first and first[0][0] == 0 and isinstance(first[0][1].events[0], AllBlocksCleared)
            h.subs[victim] = sub
            for homes in h.held.values():  # what a router does on that batch
                homes.discard(victim)
            h.pump(0.3)
            new = [f"ev-new-{i}" for i in range(8)]
            c.kv.put(new, [page] * 8)
            assert _wait(lambda: all(h.holds(k) for k in new), h, 5.0)
            # Every page the pool holds is known to the router, and nothing else.
            everything = keys + more + new
            assert _wait(lambda: [h.holds(k) for k in everything] == c.kv.present(everything), h, 5.0)
        finally:
            h.close()


def test_a_router_forgets_a_home_that_died_without_a_word() -> None:
    from tensorcast.policies.event_feed import EventFeed
    from tensorcast.policies.kv_event_index import EventIndex

    liveness = 2.0
    with running_cluster(workers=2, config={**CONFIG, "gs.worker_liveness_timeout": liveness}) as cluster, \
            tc.connect(cluster.address) as c:
        wait_shards_settled(c, set(cluster.worker_ids))
        index = EventIndex(16)
        feed = EventFeed(index, topic="tensorcast")
        feed.follow_workers(c.list_workers())
        try:
            keys = [f"dead-{i}" for i in range(32)]
            c.kv.put(keys, [np.full(4096, 1, np.uint8)] * len(keys))
            victim = cluster.worker_ids[1]
            deadline = time.monotonic() + 10
            while index.size(f"worker:{victim}") == 0 and time.monotonic() < deadline:
                feed.pump(0.1)
            assert index.size(f"worker:{victim}") > 0  # it announced its share of the pages
            cluster.kill_worker(victim)  # kill -9: no AllBlocksCleared, no BlockRemoved
            deadline = time.monotonic() + liveness + 4 * RENEW + 5.0
            while time.monotonic() < deadline:
                feed.follow_workers(c.list_workers())
                if f"worker:{victim}" not in index.sources():
                    break
                time.sleep(0.2)
            assert f"worker:{victim}" not in index.sources() and index.size(f"worker:{victim}") == 0
        finally:
            feed.close()
