"""The faster put paths keep content identity sound: a same-host put written into a pack of targets, and a
small put in one request (bytes with ``PutBegin``, hashed by the worker). The worker's side runs in process
over a real memory tier; the last tests go through a cluster."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest

import tensorcast as tc
from tensorcast.client.puts import _write_segments
from tensorcast.client.write_maps import SegmentWriter
from tensorcast.config import Config
from tensorcast.errors import InvalidArgument
from tensorcast.pool.placement import PRESETS
from tensorcast.tensors import artifact_id, normalize_tensors
from tensorcast.testing import running_cluster
from tensorcast.wire.messages import PutBegin
from tensorcast.worker.puts import PutManager
from tensorcast.worker.store import LocalStore
from tensorcast.worker.trust import BlobTrust

MiB = 1 << 20


async def _gone(artifact_id: str, tier: str) -> None:
    return None


@pytest.fixture()
def puts() -> Iterator[PutManager]:
    cfg = Config.from_flat({"worker.memory_capacity": 64 * MiB, "worker.prefault_bytes": 0,
                            "worker.shm_prefix": f"tc-test-{uuid.uuid4().hex[:8]}"})
    store = LocalStore(cfg.worker, "w", _gone)
    yield PutManager(cfg.worker, store, BlobTrust(store))
    store.close()


def _inputs(**tensors: np.ndarray) -> list:  # type: ignore[type-arg]
    return normalize_tensors(tensors)


def test_equal_tensors_are_written_and_stored_once(puts: PutManager) -> None:
    x = np.random.default_rng(1).integers(0, 255, 3 * MiB, dtype=np.uint8)
    inputs = _inputs(a=x, b=x.copy(), c=x[:1000].copy(), e=np.empty(0, np.float32))
    plan = asyncio.run(puts.begin(PutBegin(tensors=tuple(t.meta for t in inputs), same_host=True), PRESETS["cache"]))
    assert [ref is not None for ref in plan.segments] == [True, False, True, False]  # b is a's bytes; e is empty
    writer = SegmentWriter()
    _write_segments(writer, plan, inputs)
    writer.close()
    put = asyncio.run(puts.commit(plan.put_id))
    memory = puts.store.memory
    assert put.artifact_id == plan.artifact_id == artifact_id([t.meta for t in inputs])
    assert memory.state.used == 3 * MiB + 1000 and memory.state.reserved == 0
    for t, item in zip(inputs, inputs, strict=True):
        if t.nbytes:
            assert bytes(memory.blob(t.digest).view()) == item.data.tobytes()


def test_digests_later_writes_every_tensor_and_stores_each_blob_once(puts: PutManager) -> None:
    x = np.random.default_rng(2).integers(0, 255, 3 * MiB, dtype=np.uint8)
    inputs = _inputs(a=x, b=x.copy(), e=np.empty(0, np.float32))
    msg = PutBegin(tensors=tuple(t.meta_without_digest() for t in inputs), same_host=True, digests_later=True)
    plan = asyncio.run(puts.begin(msg, PRESETS["cache"]))
    assert not plan.digests_first and plan.artifact_id == ""
    assert [ref is not None for ref in plan.segments] == [True, True, False]  # identities unknown: a and b both
    assert puts.store.memory.state.reserved >= 6 * MiB
    writer = SegmentWriter()
    _write_segments(writer, plan, inputs)
    writer.close()
    digests = tuple(t.meta.digest for t in inputs)
    put = asyncio.run(puts.commit(plan.put_id, digests))
    memory = puts.store.memory
    assert put.artifact_id == artifact_id([t.meta for t in inputs])
    assert memory.state.used == 3 * MiB and memory.state.reserved == 0  # b's copy was dropped at the commit
    assert bytes(memory.blob(digests[0]).view()) == x.tobytes()
    again = asyncio.run(puts.begin(msg, PRESETS["cache"]))  # content held already: written, then dropped
    asyncio.run(puts.commit(again.put_id, digests))
    assert memory.state.used == 3 * MiB and memory.state.reserved == 0 and not puts.pending


def test_digests_later_is_checked_and_a_bad_commit_stores_nothing(puts: PutManager) -> None:
    inputs = _inputs(a=np.arange(MiB, dtype=np.uint8), b=np.ones(10, np.int64))
    msg = PutBegin(tensors=tuple(t.meta_without_digest() for t in inputs), same_host=True, digests_later=True)
    for bad in (msgspec.structs.replace(msg, same_host=False), msgspec.structs.replace(msg, inline=True)):
        with pytest.raises(InvalidArgument, match="digests_later"):
            asyncio.run(puts.begin(bad, PRESETS["cache"]))
    stated = msgspec.structs.replace(msg, tensors=(inputs[0].meta_without_digest(), inputs[1].meta))
    plan = asyncio.run(puts.begin(stated, PRESETS["cache"]))
    digests = tuple(t.meta.digest for t in inputs)
    with pytest.raises(InvalidArgument, match="not the one PutBegin stated"):
        asyncio.run(puts.commit(plan.put_id, (digests[0], "0" * 64)))
    for wrong, match in (((), "0 digests for 2"), (digests[:1], "1 digests"), ((digests[0], "x" * 64), "64 lowercase")):
        plan = asyncio.run(puts.begin(msg, PRESETS["cache"]))
        with pytest.raises(InvalidArgument, match=match):
            asyncio.run(puts.commit(plan.put_id, wrong))
    plain = asyncio.run(puts.begin(PutBegin(tensors=tuple(t.meta for t in inputs), same_host=True), PRESETS["cache"]))
    with pytest.raises(InvalidArgument, match="only after digests_later"):
        asyncio.run(puts.commit(plain.put_id, digests))
    memory = puts.store.memory
    assert memory.state.used == 0 and memory.state.reserved == 0 and not puts.pending


def test_digests_stated_with_digests_later_are_deduplicated_up_front(puts: PutManager) -> None:
    held = np.random.default_rng(3).integers(0, 255, 2 * MiB, dtype=np.uint8)
    first = _inputs(w=held)
    plan = asyncio.run(puts.begin(PutBegin(tensors=tuple(t.meta for t in first), same_host=True), PRESETS["cache"]))
    _write_segments(writer := SegmentWriter(), plan, first)
    asyncio.run(puts.commit(plan.put_id))
    fresh = np.random.default_rng(4).integers(0, 255, MiB, dtype=np.uint8)
    inputs = _inputs(w=held, z=fresh)  # w: held, digest stated; z: new, digest later
    msg = PutBegin(tensors=(inputs[0].meta, inputs[1].meta_without_digest()), same_host=True, digests_later=True)
    plan = asyncio.run(puts.begin(msg, PRESETS["cache"]))
    assert [ref is not None for ref in plan.segments] == [False, True]
    _write_segments(writer, plan, inputs)
    writer.close()
    put = asyncio.run(puts.commit(plan.put_id, tuple(t.meta.digest for t in inputs)))
    assert put.artifact_id == artifact_id([t.meta for t in inputs])
    assert puts.store.memory.state.used == 3 * MiB and puts.store.memory.state.reserved == 0


def test_digests_later_asks_for_the_digests_when_memory_must_make_room(puts: PutManager) -> None:
    big = _inputs(a=np.zeros(40 * MiB, np.uint8))
    plan = asyncio.run(puts.begin(PutBegin(tensors=tuple(t.meta for t in big), same_host=True), PRESETS["cache"]))
    _write_segments(writer := SegmentWriter(), plan, big)
    writer.close()
    asyncio.run(puts.commit(plan.put_id))
    # 40 of 64 MiB used: 30 more fit only by evicting; 22 more fit, but above the high watermark (95%), where
    # the housekeeping would evict.
    for size, preset in ((30, "cache"), (22, "cache")):
        more = _inputs(a=np.ones(size * MiB, np.uint8))
        msg = PutBegin(tensors=tuple(t.meta_without_digest() for t in more), same_host=True, digests_later=True)
        reply = asyncio.run(puts.begin(msg, PRESETS[preset]))
        assert reply.digests_first and not reply.segments and not puts.pending, (size, preset)
    assert puts.store.memory.state.reserved == 0 and puts.store.memory.has_replica(plan.artifact_id)
    fits = _inputs(a=np.ones(16 * MiB, np.uint8))  # 56 of 64 MiB: under the watermark, taken
    msg = PutBegin(tensors=tuple(t.meta_without_digest() for t in fits), same_host=True, digests_later=True)
    assert not asyncio.run(puts.begin(msg, PRESETS["cache"])).digests_first


def test_putting_held_content_with_digests_later_leaves_the_held_replica_as_it_was(puts: PutManager) -> None:
    inputs = _inputs(w=np.random.default_rng(6).integers(0, 255, 2 * MiB, dtype=np.uint8))
    plan = asyncio.run(puts.begin(PutBegin(tensors=tuple(t.meta for t in inputs), same_host=True), PRESETS["cache"]))
    _write_segments(writer := SegmentWriter(), plan, inputs)
    asyncio.run(puts.commit(plan.put_id))
    msg = PutBegin(tensors=tuple(t.meta_without_digest() for t in inputs), same_host=True, digests_later=True)
    again = asyncio.run(puts.begin(msg, PRESETS["pinned"]))  # a stronger promise, asked for the same bytes
    _write_segments(writer, again, inputs)
    writer.close()
    put = asyncio.run(puts.commit(again.put_id, tuple(t.meta.digest for t in inputs)))
    memory = puts.store.memory
    assert put.artifact_id == plan.artifact_id and not put.to_memory  # held already: not added again
    assert memory.state.replicas[plan.artifact_id].evictable  # as a hash-first put of held bytes leaves it
    assert memory.state.used == 2 * MiB and memory.state.reserved == 0


def test_a_small_put_in_one_request_is_hashed_by_the_worker(puts: PutManager) -> None:
    inputs = _inputs(a=np.arange(300, dtype=np.int16), b=np.ones(5, np.float64))
    payload = memoryview(b"".join(t.data.tobytes() for t in inputs))
    msg = PutBegin(tensors=tuple(t.meta_without_digest() for t in inputs), same_host=True, inline=True)
    plan = asyncio.run(puts.begin_inline(msg, PRESETS["cache"], payload))
    put = asyncio.run(puts.commit(plan.put_id))
    assert put.artifact_id == plan.artifact_id == artifact_id([t.meta for t in inputs])
    with pytest.raises(InvalidArgument, match="payload bytes"):
        asyncio.run(puts.begin_inline(msg, PRESETS["cache"], payload[:-1]))
    lying = msgspec.structs.replace(msg, tensors=(inputs[0].meta, msgspec.structs.replace(inputs[1].meta,
                                                                                          digest="0" * 64)))
    with pytest.raises(InvalidArgument, match="digest mismatch"):
        asyncio.run(puts.begin_inline(lying, PRESETS["cache"], payload))
    with pytest.raises(InvalidArgument, match="inline"):
        puts.inline_sink(msgspec.structs.replace(msg, inline=False))  # other puts take no payload
    assert puts.store.memory.state.reserved == 0 and not puts.pending


def test_every_path_gives_the_same_artifact_for_the_same_content(client: tc.Client,
                                                                 remote_client: tc.Client) -> None:
    rng = np.random.default_rng(7)
    data = {"big": rng.integers(0, 255, 3 * MiB, dtype=np.uint8), "mid": rng.standard_normal(40_000),
            "small": np.arange(10, dtype=np.int32), "empty": np.empty((0, 3), np.float16)}
    small = {"small": data["small"], "empty": data["empty"]}
    arts = [client.put(data), remote_client.put(data), client.put(small), remote_client.put(small)]
    assert arts[0].id == arts[1].id and arts[2].id == arts[3].id
    assert arts[0].id == artifact_id([t.meta for t in normalize_tensors(data)])
    for art, want in ((arts[0], data), (arts[2], small)):
        got = art.tensor_dict(like="numpy")
        assert all(np.array_equal(got[k], v) and got[k].shape == v.shape for k, v in want.items())
    for art in arts[::2]:
        client.delete(art.id)


def spy_put_begins(monkeypatch: pytest.MonkeyPatch) -> list[PutBegin]:
    """Every ``PutBegin`` this process's clients send (not inline ones, which go another way) from now on."""
    from tensorcast.client import puts as client_puts

    begun: list[PutBegin] = []
    call = client_puts._Put._call

    async def spy(self: client_puts._Put, msg: Any) -> object:
        if isinstance(msg, PutBegin):
            begun.append(msg)
        return await call(self, msg)

    monkeypatch.setattr(client_puts._Put, "_call", spy)
    return begun


def test_a_large_same_host_put_hashed_while_written_is_the_same_artifact(client: tc.Client,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    begun = spy_put_begins(monkeypatch)
    rng = np.random.default_rng(11)
    w = rng.integers(0, 255, 6 * MiB, dtype=np.uint8)
    data = {"w": w, "w2": w.copy(), "v": rng.standard_normal(1000)}
    art = client.put(data)
    assert [m.digests_later for m in begun] == [True]
    assert art.id == artifact_id([t.meta for t in normalize_tensors(data)])
    got = art.tensor_dict(like="numpy")
    assert all(np.array_equal(got[k], v) for k, v in data.items())
    assert client.put({k: v.copy() for k, v in data.items()}).id == art.id  # held already: the same artifact
    client.delete(art.id)


def test_putting_held_content_into_full_memory_deduplicates_instead_of_evicting() -> None:
    with running_cluster(workers=1, memory_capacity="64MiB") as cluster, tc.connect(cluster.address) as c:
        a = np.random.default_rng(1).integers(0, 255, 40 * MiB, dtype=np.uint8)
        b = np.random.default_rng(2).integers(0, 255, 20 * MiB, dtype=np.uint8)
        first = c.put(a, key="a")
        c.put(b, key="b")
        again = c.put({"tensor": a.copy()}, key="a2")  # 40 MiB more would not fit: the digests say it is here
        assert again.id == first.id
        assert np.array_equal(c.artifact("b").tensor(like="numpy"), b)  # nobody was evicted
        c.put(np.ones(30 * MiB, np.uint8), key="c")  # new bytes that do not fit: the least recently used goes
        assert {x.key for x in c.ls()} == {"b", "c"}  # a (with its second key) was read longest ago


def test_small_and_hashed_while_written_puts_keep_their_placement(monkeypatch: pytest.MonkeyPatch) -> None:
    begun = spy_put_begins(monkeypatch)
    big = np.random.default_rng(5).integers(0, 255, 6 * MiB, dtype=np.uint8)  # digests later: 4 MiB and more
    with running_cluster(workers=1, memory_capacity="64MiB") as cluster, tc.connect(cluster.address) as c:
        kept = c.put({"w": np.arange(1000, dtype=np.float32)}, key="small/durable", policy="durable")
        large = c.put({"b": big}, key="large/durable", policy="durable")
        assert [m.digests_later for m in begun if m.key == "large/durable"] == [True]
        leased = c.put(np.arange(10), key="small/leased", ttl=60.0)
        for art in (kept, large):  # the disk copy before returning
            assert {r.tier for r in art.refresh().replicas} == {"memory", "disk"}
        assert c.artifact("small/leased").id == leased.id
        cluster.kill_worker("w0")
        cluster.restart_worker("w0")
        got = c.artifact("small/durable").tensor_dict(like="numpy")
        assert np.array_equal(got["w"], np.arange(1000, dtype=np.float32))
        assert np.array_equal(c.artifact("large/durable").tensor(like="numpy"), big)


def test_copy_bytes_hint_counts_what_normalizing_copies() -> None:
    import torch

    from tensorcast.tensors import copy_bytes_hint

    assert copy_bytes_hint(np.ones(10, np.float32)) == 0  # contiguous: viewed, not copied
    assert copy_bytes_hint(np.ones((4, 4), np.float32).T) == 64
    assert copy_bytes_hint(np.ones(4, ">f4")) == 16  # big-endian: swapped into a copy
    assert copy_bytes_hint({"a": np.ones(3, np.int16), "b": torch.ones(2, 3, dtype=torch.bfloat16)}) == 0
    assert copy_bytes_hint(torch.ones(4, 4).t()) == 64  # not contiguous: normalizing copies
    assert copy_bytes_hint(torch.ones(2, dtype=torch.complex64).conj()) == 16  # a lazy conjugate: resolved by a copy
    assert copy_bytes_hint({"a": [1, 2, 3]}) is None  # not a tensor: normalizing refuses it, where it runs
