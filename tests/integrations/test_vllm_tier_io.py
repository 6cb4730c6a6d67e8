"""The vLLM tier's keys and I/O without vLLM: block namespaces, parts, and ``TierIO`` over a real cluster
(stores out of and loads into a primary region's rows, lookups of whole units, a load that finds only some
units, jobs never run on the caller's thread)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import tensorcast as tc
from tensorcast.errors import InvalidArgument
from tensorcast.integrations.vllm_block_keys import BlockNamespace, block_key, part_keys
from tensorcast.integrations.vllm_tier_io import TierIO
from tensorcast.kv_events import block_hash_of
from tensorcast.testing import running_cluster, wait_shards_settled

NS = BlockNamespace(model="m", dtype="float16", groups=((16, 2),), unit_bytes=8192)


def test_namespaces_differ_by_what_decides_the_bytes() -> None:
    assert NS.id == BlockNamespace(model="m", dtype="torch.float16", groups=((16, 2),), unit_bytes=8192).id
    others = [BlockNamespace(model="m2", dtype="float16", groups=((16, 2),), unit_bytes=8192),
              BlockNamespace(model="m", dtype="bfloat16", groups=((16, 2),), unit_bytes=8192),
              BlockNamespace(model="m", dtype="float16", groups=((32, 2),), unit_bytes=8192),
              BlockNamespace(model="m", dtype="float16", groups=((16, 2), (16, 1)), unit_bytes=8192),
              BlockNamespace(model="m", dtype="float16", groups=((16, 2),), unit_bytes=4096),
              BlockNamespace(model="m", dtype="float16", groups=((16, 2),), unit_bytes=8192, tp=2),
              BlockNamespace(model="m", dtype="float16", groups=((16, 2),), unit_bytes=8192, canonical_format="v1-hnd")]
    assert len({NS.id, *(o.id for o in others)}) == 1 + len(others)
    with pytest.raises(InvalidArgument):
        BlockNamespace(model="m", dtype="float16", groups=(), unit_bytes=8192)


def test_block_keys_carry_vllms_hash_and_group_to_events() -> None:
    h = bytes(range(32))
    key = block_key(NS.id, h, 3)
    assert block_hash_of(key) == (h, 3)
    assert block_hash_of(part_keys(key, 10, 4)[-1][0]) == (h, 3)
    for bad in (b"", b"x" * 65):
        with pytest.raises(InvalidArgument):
            block_key(NS.id, bad)
    assert part_keys("k", 10, 10) == [("k", 0, 10)]
    assert part_keys("k", 10, 4) == [("k/p0", 0, 4), ("k/p1", 4, 8), ("k/p2", 8, 10)]


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    config = {"kv.max_page_bytes": 64 * 1024, "kv.arena_bytes": 16 << 20}
    with running_cluster(workers=2, config=config) as c, tc.connect(c.address) as client:
        wait_shards_settled(client, set(c.worker_ids))
        yield client


def _rows(chunks: int, unit: int) -> np.ndarray:
    return np.zeros((chunks, unit + 512), np.uint8)  # rows padded beyond the unit, as vLLM aligns them


@pytest.mark.parametrize("unit", [8192, 150 * 1024])  # one page; three parts of at most 64 KiB
def test_units_roundtrip_between_regions(client: Any, unit: int) -> None:
    src, dst = _rows(8, unit), _rows(8, unit)
    rng = np.random.default_rng(unit)
    src[:, :] = rng.integers(0, 256, src.shape, dtype=np.uint8)
    keys = [block_key(NS.id, f"{unit}-{i}".encode(), 0) for i in range(6)]
    a, b = TierIO(client, src, unit, max_page_bytes=64 * 1024), TierIO(client, dst, unit, max_page_bytes=64 * 1024)
    try:
        assert a.present(keys) == [False] * 6
        a.store(1, keys, [2, 3, 4, 5, 6, 7])
        assert a.drain(30)
        (done,) = a.finished()
        assert done.success and done.job_id == 1 and done.nbytes == 6 * unit
        assert b.present(keys) == [True] * 6
        b.load(2, keys[:4], [0, 1, 2, 3])
        assert b.drain(30)
        (done,) = b.finished()
        assert done.success and done.ok is None
        assert np.array_equal(dst[:4, :unit], src[2:6, :unit])
        assert not dst[:4, unit:].any()  # only the unit is written, never the row's padding
    finally:
        a.close()
        b.close()


def test_a_load_reports_which_units_arrived_whole(client: Any) -> None:
    unit = 100 * 1024  # two parts
    src, dst = _rows(4, unit), _rows(4, unit)
    src[:] = 9
    keys = [block_key(NS.id, f"partial-{i}".encode(), 0) for i in range(4)]
    io = TierIO(client, src, unit, max_page_bytes=64 * 1024)
    io.store(1, keys[:2], [0, 1])
    io.drain(30)
    # Unit 3's first part alone is there (a store cut short): it is not present, and not loaded.
    client.kv.put([part_keys(keys[3], unit, 64 * 1024)[0][0]], [np.full(64 * 1024, 9, np.uint8)])
    assert io.present(keys) == [True, True, False, False]
    reader = TierIO(client, dst, unit, max_page_bytes=64 * 1024)
    try:
        reader.load(7, keys, [0, 1, 2, 3])
        reader.drain(30)
        (done,) = reader.finished()
        assert not done.success and done.ok == (0, 1) and done.nbytes == 2 * unit
        assert (dst[:2, :unit] == 9).all()
        assert reader.stats["load_misses"] == 2
    finally:
        io.close()
        reader.close()


def test_jobs_run_off_the_callers_thread_and_bad_jobs_fail_alone(client: Any) -> None:
    unit = 8192
    rows = _rows(4, unit)
    main = threading.get_ident()
    seen: list[int] = []

    class SlowKV:
        def __init__(self, kv: Any) -> None:
            self.kv = kv

        def put(self, *args: Any, **kwargs: Any) -> Any:
            seen.append(threading.get_ident())
            time.sleep(0.3)
            return self.kv.put(*args, **kwargs)

    class SlowClient:
        kv = SlowKV(client.kv)
        aio = client.aio

    io = TierIO(SlowClient(), rows, unit)
    try:
        start = time.monotonic()
        io.store(1, [block_key(NS.id, b"slow", 0)], [0])
        assert time.monotonic() - start < 0.1  # queued, not run here
        io.store(2, ["k1", "k2"], [0])  # keys and chunks differ in length: this job fails, typed
        assert io.drain(30)
        results = {f.job_id: f.success for f in io.finished()}
        assert results == {1: True, 2: False} and seen and main not in seen
    finally:
        io.close()
    with pytest.raises(InvalidArgument):
        TierIO(client, np.zeros((2, 10), np.uint8), 11)
