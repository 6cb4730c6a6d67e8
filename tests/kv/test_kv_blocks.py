"""The fast paths of KV pages: a batch's shards computed once, the shard home's one-step token check (same
answers as the shard-by-shard one), read leases counted on pages, and same-host copies straight between a
home's arena slots and the blocks of a paged cache (vectorized, no staging), against the socket path."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

import tensorcast as tc
from tensorcast.client.kv_local import LocalArenas, _rows
from tensorcast.cluster import LocalCluster
from tensorcast.config import KVConfig
from tensorcast.errors import InvalidArgument, StaleFencingToken
from tensorcast.kv.blocks import BlockRegions
from tensorcast.kv.home import ShardHome
from tensorcast.kv.hrw import assignment
from tensorcast.kv.keys import key_hash, key_hashes, shard_of, shards_of
from tensorcast.kv.pages import PageStore
from tensorcast.testing import leaked_segments, running_cluster

KEYS = ["a", "é" * 100, "x" * 512, "vllm@qwen@1@0@7", *(f"{i:032x}" for i in range(200)), str(10**18)]


def test_batch_shards_are_shard_of() -> None:
    for n in (1, 7, 256, 4096):
        assert shards_of(KEYS, n) == [shard_of(k, n) for k in KEYS]
    assert key_hashes(KEYS) == [key_hash(k) for k in KEYS] and shards_of([], 256) == []


def _home(shards: int = 16) -> ShardHome:
    home = ShardHome("w0", KVConfig(lease_margin=0.0), gs=None, shm_prefix="tctest-check")  # type: ignore[arg-type]
    home.num_shards = shards
    return home


def test_token_check_in_one_step_answers_like_shard_by_shard() -> None:
    home = _home()
    try:
        now = time.monotonic()
        for s in range(16):
            home.leases.granted(s, token=10 + s, sent_at=now, ttl=60.0)
        home.served.changed()
        keys = tuple(KEYS[:40])
        shards = [shard_of(k, 16) for k in keys]
        tokens = {s: 10 + s for s in set(shards)}
        assert home.served.check(keys, tokens) == shards
        # A stale token for a shard the keys fall in; a missing one; an extra stale one (ignored, as before).
        s0 = shards[0]
        with pytest.raises(StaleFencingToken):
            home.served.check(keys, {**tokens, s0: 9 + s0})
        with pytest.raises(InvalidArgument, match="no fencing token"):
            home.served.check(keys, {s: t for s, t in tokens.items() if s != s0})
        unused = next(s for s in range(16) if s not in tokens)
        assert home.served.check(keys, {**tokens, unused: 1}) == shards
        # A newer token (any value a caller makes up, 2**63 included) is refused without side effects: the
        # home keeps the shard and its pages, and still serves the current token.
        for newer in (11 + s0, 2**63 - 1):
            with pytest.raises(StaleFencingToken):
                home.served.check(keys, {**tokens, s0: newer})
            assert home.leases.held[s0].token == 10 + s0
            assert home.served.check(keys, tokens) == shards
        # Being handed over to this home: refused until its pages arrived.
        home.served.receiving.add(s0)
        home.served.changed()
        with pytest.raises(StaleFencingToken, match="handed over"):
            home.served.check(keys, tokens)
        home.served.receiving.discard(s0)
        home.served.changed()
        assert home.served.check(keys, tokens) == shards
        # Past the local expiry: refused, whatever the token.
        home.leases.granted(s0, token=11 + s0, sent_at=now - 120, ttl=60.0)
        home.served.changed()
        with pytest.raises(StaleFencingToken):
            home.served.check((keys[0],), {s0: 11 + s0})
        with pytest.raises(InvalidArgument):
            home.served.check(("ok", ""), {shard_of("ok", 16): 10 + shard_of("ok", 16), shard_of("", 16): 0})
    finally:
        home.store.close()
    assert not leaked_segments("tctest-check")


def test_read_leases_on_pages_keep_freed_slots_until_released() -> None:
    store = PageStore(2 * 8192, "tctest-leases", arena_bytes=16 * 1024, max_page_bytes=8192, default_ttl=None)
    try:
        for i in range(2):
            page, view = store.reserve(0, f"k{i}", 8000, now=0)
            view[:] = bytes([i + 1]) * 8000
            store.commit(f"k{i}", page, None, now=0)
        held = store.get_many(["k0", "k1", "nope"], now=0)
        assert held[2] is None and store.present(["k0", "nope", "k1"], now=0) == b"\x01\x00\x01"
        release = store.hold([p for p in held if p is not None])
        view0 = store.view(held[0])  # type: ignore[arg-type]
        for i in range(4):  # full: evicts k0 and k1, whose slots are leased: pages go to new arenas
            page, view = store.reserve(1, f"n{i}", 8000, now=1)
            view[:] = b"\xff" * 8000
            store.commit(f"n{i}", page, None, now=1)
        assert store.get("k0", now=1) is None and bytes(view0[:4]) == b"\x01" * 4
        release()
        page, view = store.reserve(1, "after", 8000, now=2)  # the freed slots are reusable again
        store.abandon(page)
        page, _ = store.reserve(1, "short", 100, now=2)
        store.commit("short", page, ttl=1.0, now=2)
        assert store.get_many(["short", "short"], now=5) == [None, None]  # expired, asked twice: freed once
    finally:
        store.close()
    assert not leaked_segments("tctest-leases")


def _cache(blocks: int, widths: list[int], seed: int) -> tuple[list[np.ndarray], BlockRegions]:
    rng = np.random.default_rng(seed)
    arrays = [rng.integers(0, 255, (blocks, w), dtype=np.uint8) for w in widths]
    return arrays, BlockRegions(arrays)


def test_block_regions_load_and_store_rows_of_any_byte_array() -> None:
    _, regions = _cache(10, [3, 5, 8], seed=1)
    ids = np.array([7, 2, 9])
    rows = np.zeros((40, regions.page_bytes + 4), np.uint8)
    at = np.array([30, 0, 11])
    regions.store(ids, rows, at)
    assert np.array_equal(rows[at, : regions.page_bytes], regions.gather(ids))
    other, into = _cache(10, [3, 5, 8], seed=2)
    before = [a.copy() for a in other]
    into.load(np.array([1, 4, 5]), rows, at)
    assert np.array_equal(into.gather(np.array([1, 4, 5])), regions.gather(ids))
    untouched = [0, 2, 3, 6, 7, 8, 9]
    assert all(np.array_equal(a[untouched], b[untouched]) for a, b in zip(other, before, strict=True))
    # An arena seen as overlapping rows: row o starts at byte o (any slot offsets, no slot size needed).
    arena = bytearray(range(256)) * 4
    view = _rows(arena, 16)  # type: ignore[arg-type]
    assert view.shape == (1024 - 16 + 1, 16) and bytes(view[300]) == bytes(arena[300:316])


def test_local_arenas_copy_between_slots_and_blocks_across_arenas() -> None:
    page_bytes = 3000  # not a power of two: slots are 4 KiB, pages fill them partly
    store = PageStore(1 << 20, "tctest-local", arena_bytes=16 * 1024, max_page_bytes=8192, default_ttl=None)
    arenas = LocalArenas(lambda address: None)
    try:
        keys = [f"p{i}" for i in range(10)]  # 4 slots per arena: three arenas
        reserved = [store.reserve(0, k, page_bytes, now=0)[0] for k in keys]
        slots = store.slot_list([None if i == 3 else p for i, p in enumerate(reserved)])  # 3: already stored
        _, regions = _cache(20, [1000, 2000], seed=3)
        ids = np.arange(10) * 2
        arenas.from_blocks(slots, "here", regions, ids)
        for i, (k, p) in enumerate(zip(keys, reserved, strict=True)):
            store.commit(k, p, None, now=0)
            want = b"\0" * page_bytes if i == 3 else regions.gather(ids[i : i + 1]).tobytes()
            assert i == 3 or bytes(store.view(p)) == want
        assert len({p.arena for p in reserved}) == 3
        hits = [p for i, p in enumerate(reserved) if i != 3]
        dst, into = _cache(20, [1000, 2000], seed=4)
        before = [a.copy() for a in dst]
        targets = np.array([1, 3, 5, 7, 9, 11, 13, 15, 17])
        arenas.to_blocks(store.slot_list(hits), "here", into, targets)
        assert np.array_equal(into.gather(targets), regions.gather(np.delete(ids, 3)))
        assert all(np.array_equal(a[::2], b[::2]) for a, b in zip(dst, before, strict=True))  # others untouched
        views = arenas.views(store.slot_list([None, *hits[:2]]), "here")
        assert views[0] is None and bytes(views[2]) == regions.gather(ids[1:2]).tobytes()  # type: ignore[index]
        del views
        _, wrong = _cache(20, [1000, 1000], seed=5)
        with pytest.raises(InvalidArgument, match="not a block"):
            arenas.to_blocks(store.slot_list(hits), "here", wrong, targets)
    finally:
        arenas.close()
        store.close()
    assert not leaked_segments("tctest-local")


# Small arenas, so that one batch spans several; two homes, so that a batch spans both.
CONFIG = {"kv.arena_bytes": 256 * 1024, "kv.max_page_bytes": 64 * 1024, "kv.lease_ttl": 3.0}


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with running_cluster(workers=2, config=CONFIG) as c:
        with tc.connect(c.address) as client:  # pages put while shards move to their homes are misses
            deadline = time.monotonic() + 30
            while True:
                table = client.list_shards()
                want = assignment(table.num_shards, set(c.worker_ids))
                if all(lease.holder == want[lease.shard] and lease.expiry > table.now for lease in table.leases) \
                        and len(table.leases) == table.num_shards:
                    break
                assert time.monotonic() < deadline, "shards not settled on their homes"
                time.sleep(0.1)
        yield c


@pytest.mark.parametrize("where", ["same host", "another host"])
def test_blocks_and_prefix_lookups_through_both_paths(cluster: LocalCluster, where: str) -> None:
    config = tc.Config.from_flat({"client.host_id": "far-away"}) if where == "another host" else None
    tag = where.replace(" ", "-")
    with tc.connect(cluster.address, config=config) as c:
        _, regions = _cache(400, [4096, 2048, 2048, 8192], seed=6)  # 16 KiB pages
        keys = [f"{tag}/blk/{i}" for i in range(150)]
        blocks = np.arange(150) * 2 + 1
        assert c.kv.put_blocks(keys, blocks, regions) == 150
        assert c.kv.put_blocks(keys[:10], blocks[:10], regions) == 0  # already stored
        assert c.kv.exists(keys) == 150
        assert c.kv.exists([*keys[:70], f"{tag}/nope", *keys[70:]]) == 70
        dst, into = _cache(400, [4096, 2048, 2048, 8192], seed=7)
        before = [a.copy() for a in dst]
        asked = [*keys[:100], f"{tag}/missing", *keys[100:]]
        targets = np.arange(151)[::-1].copy()
        hits = c.kv.get_blocks(asked, targets, into)
        assert hits == [True] * 100 + [False] + [True] * 50
        got = targets[np.flatnonzero(hits)]
        assert np.array_equal(into.gather(got), regions.gather(blocks))
        miss = targets[100]
        assert all(np.array_equal(a[miss], b[miss]) for a, b in zip(dst, before, strict=True))
        assert all(np.array_equal(a[151:], b[151:]) for a, b in zip(dst, before, strict=True))
        pages = c.kv.get(keys[:5])
        assert all(np.array_equal(p, regions.gather(blocks[i : i + 1])[0]) for i, p in enumerate(pages))
        _, small = _cache(400, [4096, 2048], seed=8)
        with pytest.raises(InvalidArgument):
            c.kv.get_blocks(keys[:3], [0, 1, 2], small)  # 6 KiB blocks: the 16 KiB pages do not fit
