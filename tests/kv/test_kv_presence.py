"""Same-host lookups answered from a shard home's presence table (``kv.presence``), without a round trip.

Without processes: the table against a model (inserts, removals, tombstones, overflowing buckets, rebuilds
and the generation change a reader sees), expiries, and the lease rules a reader applies (token, serve-until,
sequence number, shard count, clock, a restarted home), on a page store and a shard home as they publish.
With a cluster: lookups answered without requests that agree with the homes' answers over random puts,
evictions and expiries; a page past its TTL is absent; a shard that moved away (kill -9, SIGSTOP past the
lease) is never vouched for by its old home's table; ``present`` and ``get_into`` with a layout."""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator

import numpy as np
import pytest

import tensorcast as tc
from tensorcast.cluster import LocalCluster
from tensorcast.config import KVConfig
from tensorcast.errors import InvalidArgument
from tensorcast.kv.home import ShardHome
from tensorcast.kv.keys import KVLayout, key_hash, key_hash_array, shard_of
from tensorcast.kv.pages import PageStore
from tensorcast.kv.presence import BUCKET
from tensorcast.kv.presence_reader import PresenceReader
from tensorcast.kv.presence_writer import PresenceWriter
from tensorcast.pool.segments import SHM_DIR
from tensorcast.testing import leaked_segments, running_cluster, wait_shards_settled

INF = float("inf")
GOLDEN = 0x9E3779B97F4A7C15
LAYOUT = KVLayout("presence-model", layers=2, kv_heads=2, head_dim=32, dtype="float16", page_size=16)
TTL, RENEW = 2.0, 0.5
FAST_LEASES = {"kv.lease_ttl": TTL, "kv.renew_interval": RENEW}


def hashes(n: int, seed: int) -> list[int]:
    return [random.Random(seed * 1_000_003 + i).getrandbits(64) for i in range(n)]


def stored(h: int) -> int:
    return max(h, 2)


def ask(reader: PresenceReader, hs: list[int], shards: list[int], tokens: list[int],
        num_shards: int = 16) -> tuple[list[bool], list[bool]] | None:
    by_shard = np.zeros(num_shards, np.uint64)  # the caller's token of each shard (each shard asked with one)
    by_shard[shards] = tokens
    got = reader.answer(np.array(hs, np.uint64), np.array(shards, np.intp), by_shard)
    return None if got is None else (got[0].tolist(), got[1].tolist())


@pytest.fixture
def table() -> Iterator[tuple[PresenceWriter, PresenceReader]]:
    writer = PresenceWriter(SHM_DIR, "tctest-presence")
    writer.publish_leases({s: (7, time.monotonic() + 600) for s in range(16)}, 16, time.monotonic())
    reader = PresenceReader(writer.path)
    try:
        yield writer, reader
    finally:
        reader.close()
        writer.close()
        assert not leaked_segments("tctest-presence")


def test_inserts_removals_and_rebuilds_match_a_model(table: tuple[PresenceWriter, PresenceReader]) -> None:
    writer, reader = table
    rng = random.Random(5)
    pool = [*hashes(20000, seed=1), 0, 1]  # the markers' values: stored as 2 (one more 2^-64 collision)
    model: dict[int, float] = {}  # by the hash as stored
    generations = {writer.generation}
    for step in range(400):
        batch = rng.sample(pool, rng.choice([1, 5, 31, 32, 200, 1000]))  # key by key, and vectorized
        if rng.random() < 0.6:
            expiry = [rng.choice([INF, time.monotonic() + 600, time.monotonic() - 1]) for _ in batch]
            if len(batch) > 40:  # a key twice in one batch: the last expiry counts
                batch, expiry = [*batch, batch[0]], [*expiry, INF]
            writer.add_many(batch, expiry)
            model.update(zip(map(stored, batch), expiry, strict=True))
        else:
            writer.remove_many(batch)
            for h in batch:
                model.pop(stored(h), None)
        generations.add(writer.generation)
        if step % 20 == 0 or step == 399:
            probe = rng.sample(pool, 300)
            got = ask(reader, probe, [h % 16 for h in probe], [7] * len(probe))
            assert got is not None
            now = time.monotonic()
            assert got == ([model.get(stored(h), 0.0) > now for h in probe], [True] * len(probe))
    # Rebuilds happened (growth, tombstones cleaned up) and the reader followed each generation.
    assert len(generations) > 2
    assert writer.live == len(model) and writer.used <= writer.capacity // 2


def test_tombstones_are_cleaned_up_by_rebuilds(table: tuple[PresenceWriter, PresenceReader]) -> None:
    writer, reader = table
    for rnd in range(30):  # churn: every key inserted once and removed; tombstones pile up, then go
        batch = hashes(500, seed=100 + rnd)
        writer.add_many(batch, [INF] * len(batch))
        writer.remove_many(batch[:-1])
        assert writer.live == rnd + 1
    assert writer.capacity <= 8192  # sized to what is live, not to everything ever inserted
    last = [hashes(500, seed=100 + rnd)[-1] for rnd in range(30)]
    got = ask(reader, last, [0] * 30, [7] * 30)
    assert got is not None and all(got[0])


def test_overflowing_buckets_are_searched_on_and_a_reader_gives_up_far_away(
        table: tuple[PresenceWriter, PresenceReader]) -> None:
    writer, reader = table
    buckets = writer.capacity // BUCKET
    shift = 64 - (buckets.bit_length() - 1)
    inverse = pow(GOLDEN, -1, 1 << 64)
    # 10 full buckets' worth of keys that all start in bucket 3: they spill over into buckets 4..13.
    same = [((3 << shift) | (i + 1)) * inverse % (1 << 64) for i in range(10 * BUCKET)]
    assert {(h * GOLDEN % (1 << 64)) >> shift for h in same} == {3}
    for h in same[:40]:
        writer.add(h, INF)
    writer.add_many(same[40:], [INF] * 40)
    absent = ((3 << shift) | 999) * inverse % (1 << 64)
    got = ask(reader, [*same, absent], [0] * 81, [7] * 81)
    assert got is not None
    present, vouched = got
    # Within the reader's reach (8 buckets from home) every key is decided; beyond, left to the home.
    assert present[:64] == [True] * 64 and vouched[:64] == [True] * 64
    assert not any(vouched[64:])
    writer.remove_many(same[:8])  # the home bucket is all tombstones: the search goes on past them
    got = ask(reader, same[8:16], [0] * 8, [7] * 8)
    assert got is not None and got[0] == [True] * 8
    # Keys of the last bucket spill into the spill bucket, never around to the first; past it, the table grows.
    end = [(((buckets - 1) << shift) | (i + 1)) * inverse % (1 << 64) for i in range(2 * BUCKET + 1)]
    for h in end[: 2 * BUCKET]:
        writer.add(h, INF)
    assert writer.capacity == buckets * BUCKET
    writer.add(end[-1], INF)
    assert writer.capacity == 2 * buckets * BUCKET
    got = ask(reader, end, [0] * len(end), [7] * len(end))
    assert got is not None and all(got[0]) and all(got[1])
    got = ask(reader, same[8:], [0] * 72, [7] * 72)  # rebuilt: still one run of buckets, found where vouched
    assert got is not None and got[0] == got[1] and sum(got[0]) >= 64


def test_a_reader_vouches_only_under_the_callers_token_before_serve_until(
        table: tuple[PresenceWriter, PresenceReader]) -> None:
    writer, reader = table
    hs = hashes(4, seed=9)
    writer.add_many(hs, [INF] * 4)
    now = time.monotonic()
    writer.publish_leases({0: (7, now + 600), 1: (8, now + 600), 2: (7, now - 0.001)}, 16, now)
    got = ask(reader, hs, [0, 1, 2, 3], [7, 7, 7, 7])
    # Shard 0: held under the caller's token. 1: another token. 2: past serve-until. 3: not held.
    assert got == ([True, False, False, False], [True, False, False, False])
    assert ask(reader, hs, [0, 1, 2, 3], [7, 7, 7, 7], num_shards=32) is None  # another shard numbering
    # A lease table being written (odd sequence number) is never used; nor one whose clock is ahead of ours.
    header = writer._t.header  # type: ignore[union-attr]
    header[1] += 1
    assert ask(reader, hs, [0] * 4, [7] * 4) is None
    header[1] += 1
    assert ask(reader, hs, [0] * 4, [7] * 4) is not None
    writer.publish_leases({0: (7, now + 600)}, 16, time.monotonic() + 60)
    assert ask(reader, hs, [0] * 4, [7] * 4) is None
    writer.publish_leases({0: (7, now + 600)}, 16, time.monotonic())
    # A new shard count rebuilds the table: the reader follows, and the pages stay.
    writer.publish_leases({s: (7, now + 600) for s in range(32)}, 32, time.monotonic())
    assert ask(reader, hs, [h % 32 for h in hs], [7] * 4, num_shards=32) == ([True] * 4, [True] * 4)
    writer.close()  # a closed table vouches for nothing
    assert ask(reader, hs, [h % 32 for h in hs], [7] * 4, num_shards=32) is None


def test_a_page_store_publishes_commits_evictions_expiries_and_dropped_shards() -> None:
    store = PageStore(8 * 4096, "tctest-pstore", arena_bytes=64 * 1024, max_page_bytes=8192, default_ttl=None,
                      presence=True)
    try:
        assert store.presence is not None
        reader = PresenceReader(store.presence.path)
        store.presence.publish_leases({s: (1, time.monotonic() + 600) for s in range(4)}, 4, time.monotonic())
        rng = random.Random(3)
        keys = [f"k{i}" for i in range(40)]
        for step in range(300):
            key = rng.choice(keys)
            now = time.monotonic()
            if rng.random() < 0.8:  # full at 8 pages: puts evict the least recently used
                with store.batch() if rng.random() < 0.5 else contextlib.nullcontext():  # evictions leave at once
                    page, _ = store.reserve(shard_of(key, 4), key, 4096, now)
                store.commit(key, page, rng.choice([None, 600.0, 0.001]), now)
            elif rng.random() < 0.5:
                store.drop_shard(rng.randrange(4))
            else:
                store.expire(now)
            if step % 10 == 0:
                time.sleep(0.002)  # let 1 ms TTLs pass
                got = reader.answer(key_hash_array(keys), np.array([shard_of(k, 4) for k in keys]),
                                    np.ones(4, np.uint64))
                assert got is not None and got[1].all()
                assert bytes(got[0].astype(np.uint8)) == store.present(keys, time.monotonic())
        reader.close()
    finally:
        store.close()
    assert not leaked_segments("tctest-pstore")


def test_a_restarted_homes_old_table_is_not_trusted() -> None:
    """A home restarted under the same worker id may be granted its old leases again, under the same tokens,
    without its pages: its start removes the old table's files, and readers stop trusting it at once."""
    old = PageStore(1 << 20, "tctest-restart", arena_bytes=64 * 1024, max_page_bytes=8192, presence=True)
    new: PageStore | None = None
    try:
        assert old.presence is not None
        reader = PresenceReader(old.presence.path)
        old.presence.publish_leases({0: (3, time.monotonic() + 600)}, 1, time.monotonic())
        page, _ = old.reserve(0, "k", 100, time.monotonic())
        old.commit("k", page, None, time.monotonic())
        args = (key_hash_array(["k"]), np.zeros(1, np.intp), np.full(1, 3, np.uint64))
        assert reader.answer(*args) is not None
        new = PageStore(1 << 20, "tctest-restart", arena_bytes=64 * 1024, max_page_bytes=8192, presence=True)
        assert reader.answer(*args) is None
        reader.close()
    finally:
        old.close()
        if new is not None:
            new.close()
    assert not leaked_segments("tctest-restart")


def test_a_shard_home_withdraws_a_lease_before_dropping_its_pages() -> None:
    home = ShardHome("w0", KVConfig(lease_margin=0.0), gs=None, shm_prefix="tctest-phome")  # type: ignore[arg-type]
    try:
        home.num_shards = 16
        now = time.monotonic()
        for s in range(16):
            home.leases.granted(s, token=10 + s, sent_at=now, ttl=60.0)
        home.served.changed()
        keys = [f"key-{i}" for i in range(64)]
        for key in keys:
            page, _ = home.store.reserve(shard_of(key, 16), key, 100, now)
            home.store.commit(key, page, None, now)
        assert home.store.presence is not None
        reader = PresenceReader(home.store.presence.path)
        shards = np.array([shard_of(k, 16) for k in keys])

        def answer() -> tuple[np.ndarray, np.ndarray]:
            got = reader.answer(key_hash_array(keys), shards, np.arange(10, 26, dtype=np.uint64))
            assert got is not None
            return got

        assert answer()[0].all()
        s0 = int(shards[0])
        home._step_down(s0, "test")
        present, vouched = answer()
        assert not vouched[shards == s0].any() and present[shards != s0].all()
        # Its own serve-until (local expiry), published as it is: past it, nothing is vouched for.
        home.leases.granted(s0, token=10 + s0, sent_at=now - 120, ttl=60.0)
        home.served.changed()
        assert not answer()[1][shards == s0].any()
        reader.close()
    finally:
        home.store.close()
    assert not leaked_segments("tctest-phome")


# ----------------------------------------------------------------- with processes
def page_for(key: str, nbytes: int = LAYOUT.page_bytes) -> np.ndarray:
    return np.random.default_rng(key_hash(key)).integers(0, 255, nbytes, dtype=np.uint8)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    # Room for ~100 pages per home, so that random puts evict.
    config = {"kv.memory_capacity": 100 * 4096, "kv.arena_bytes": 1 << 20, "kv.max_page_bytes": 64 << 10}
    with running_cluster(workers=2, config=config) as c:
        yield c


def asking_client(cluster: LocalCluster, **kv: object) -> tc.Client:
    flat = {"kv.same_host_exists": False, **{f"kv.{k}": v for k, v in kv.items()}}
    return tc.connect(cluster.address, config=tc.Config.from_flat(flat))


def test_lookups_without_requests_agree_with_the_homes_over_puts_evictions_and_expiries(
        cluster: LocalCluster) -> None:
    with tc.connect(cluster.address) as c, asking_client(cluster) as homes:
        wait_shards_settled(c, set(cluster.worker_ids))
        pool = [f"rand-{i}" for i in range(300)]
        c.kv.put(pool[:2], [page_for(k, 4096) for k in pool[:2]])
        c.kv.present(pool)  # the homes' replies name their presence tables
        rng = random.Random(11)
        stable = agree = 0
        asked = c.aio.kv.exists_requests
        for _ in range(40):
            batch = rng.sample(pool, rng.randrange(1, 60))
            ttl = rng.choice([None, 1.0, 30.0])  # 1 s: the shortest TTL a put may ask for
            homes.kv.put(batch, [page_for(k, 4096) for k in batch], ttl=ttl)
            time.sleep(rng.choice([0.0, 0.0, 0.1, 0.5]))
            probe = rng.sample(pool, 100)
            first, truth, second = c.kv.present(probe), homes.kv.present(probe), c.kv.present(probe)
            # Pages only expire between the three (no puts): each answer lies between its neighbours.
            assert all(a >= t >= b for a, t, b in zip(first, truth, second, strict=True))
            n1, n, n2 = c.kv.exists(probe), homes.kv.exists(probe), c.kv.exists(probe)
            assert n1 >= n >= n2
            stable += first == second
            agree += first == truth == second and n1 == n == n2
        assert agree >= 10 and stable >= 10, (agree, stable)  # most rounds saw no expiry between the three
        # All of them answered here: no KVExists request was needed (both homes are on this host).
        assert c.aio.kv.exists_requests == asked
        assert c.kv.present(pool[:5]) == c._run(c.aio.kv.present(pool[:5]))
        assert c.kv.exists([]) == 0 and c.kv.present([]) == []
        with pytest.raises(InvalidArgument):
            c.kv.exists(["ok", ""])


def test_a_page_past_its_ttl_is_absent_without_asking(cluster: LocalCluster) -> None:
    with tc.connect(cluster.address) as c:
        wait_shards_settled(c, set(cluster.worker_ids))
        keys = [f"ttl-{i}" for i in range(20)]
        page_ttl = 1.5
        put_at = time.monotonic()  # the pages expire after put_at + page_ttl, and by put_done + page_ttl
        c.kv.put(keys, [page_for(k, 4096) for k in keys], ttl=page_ttl)
        put_done = time.monotonic()
        c.kv.present(keys[:1] + [f"other-{i}" for i in range(64)])  # both homes' tables named
        before = c.kv.present(keys)
        if time.monotonic() - put_at < page_ttl * 0.8:  # not when this machine stalled past the TTL
            assert before == [True] * len(keys)
        asked = c.aio.kv.exists_requests
        time.sleep(max(0.0, put_done + page_ttl + 0.1 - time.monotonic()))
        # No lookup freed them at the homes: the tables still hold them, and their expiries rule them out.
        assert c.kv.present(keys) == [False] * len(keys) and c.kv.exists(keys) == 0
        assert c.aio.kv.exists_requests == asked


def test_get_into_with_a_layout_refuses_a_page_of_another_size(cluster: LocalCluster) -> None:
    with tc.connect(cluster.address) as c, \
            tc.connect(cluster.address, config=tc.Config.from_flat({"client.host_id": "elsewhere"})) as remote:
        wait_shards_settled(c, set(cluster.worker_ids))
        small = page_for("odd-size", LAYOUT.page_bytes // 2)
        c.kv.put(["odd-size", "right-size"], [small, page_for("right-size")])
        for client in (c, remote):  # same host (copied from the slots) and over the network
            buffers = [np.zeros(LAYOUT.page_bytes, np.uint8) for _ in range(2)]
            assert client.kv.get_into(["right-size"], buffers[:1], layout=LAYOUT) == [True]
            with pytest.raises(InvalidArgument, match="page of this layout"):
                client.kv.get_into(["odd-size", "right-size"], buffers, layout=LAYOUT)
            # Without a layout, a smaller page fills the first bytes of its buffer.
            buffers[0][:] = 7
            assert client.kv.get_into(["odd-size"], buffers[:1]) == [True]
            assert np.array_equal(buffers[0][: small.size], small) and (buffers[0][small.size :] == 7).all()


def _pages_of(c: tc.Client, holder: str, n: int) -> tuple[list[str], dict[int, int]]:
    """``n`` keys on shards ``holder`` holds, stored; and those shards' fencing tokens."""
    table = c.list_shards()
    lease = {entry.shard: entry for entry in table.leases}
    keys = [k for k in (f"moved-{holder}-{i}" for i in range(2000))
            if lease[shard_of(k, table.num_shards)].holder == holder][:n]
    c.kv.put(keys, [page_for(k, 4096) for k in keys])
    return keys, {shard_of(k, table.num_shards): lease[shard_of(k, table.num_shards)].token for k in keys}


def test_a_killed_homes_table_never_vouches_once_its_shards_moved() -> None:
    with running_cluster(workers=3, config=FAST_LEASES) as cluster, \
            tc.connect(cluster.address, config=tc.Config.from_flat({"kv.request_timeout": 1.0})) as c:
        wait_shards_settled(c, set(cluster.worker_ids))
        keys, tokens = _pages_of(c, "w2", 8)
        assert c.kv.present(keys) == [True] * 8
        asked = c.aio.kv.exists_requests
        assert c.kv.present(keys) == [True] * 8 and c.aio.kv.exists_requests == asked  # from w2's table
        cluster.kill_worker("w2")
        after = wait_shards_settled(c, {"w0", "w1"}, timeout=TTL + RENEW + 10)
        assert all(after[s][1] > tokens[s] for s in tokens)
        # The client's lease table still names w2 and its tokens, and w2's table still holds the pages under
        # them: its serve-until passed before the store could grant the shards again.
        flags = c.aio.kv.local_presence.flags(keys)
        assert flags is None or not flags[1].any()
        assert c.kv.present(keys) == [False] * 8  # asked of the new homes, which never saw them
        c.kv.put(keys, [page_for(k, 4096) for k in keys])
        assert c.kv.present(keys) == [True] * 8


def test_a_paused_homes_table_stops_vouching_at_its_serve_until() -> None:
    with running_cluster(workers=3, config=FAST_LEASES) as cluster, \
            tc.connect(cluster.address, config=tc.Config.from_flat({"kv.request_timeout": 1.0})) as c:
        wait_shards_settled(c, set(cluster.worker_ids))
        keys, tokens = _pages_of(c, "w1", 8)
        assert c.kv.present(keys) == [True] * 8
        cluster.pause_worker("w1")
        try:
            time.sleep(TTL)  # its serve-until (at most TTL - margin after its last renewal) has passed
            flags = c.aio.kv.local_presence.flags(keys)
            assert flags is None or not flags[1].any()
            after = wait_shards_settled(c, {"w0", "w2"}, timeout=TTL + RENEW + 10)
            assert all(after[s][1] > tokens[s] for s in tokens)
            assert c.kv.present(keys) == [False] * 8
        finally:
            cluster.resume_worker("w1")
        # Woken, it steps down (its pages are dropped); the shards return to it under new tokens.
        wait_shards_settled(c, set(cluster.worker_ids), timeout=15)
        assert c.kv.present(keys) == [False] * 8 and c.kv.exists(keys) == 0
