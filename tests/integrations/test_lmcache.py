"""LMCache 0.5.6 on TensorCast, through LMCache's own classes on CPU, over a real two-worker cluster.

- Two LMCache engines (``LMCacheEngineBuilder``, a CPU stand-in for the GPU connector: KV in a CPU tensor):
  A stores a prompt's KV, a fresh B finds and retrieves it byte for byte through the plug-in, with chunks
  of one page and chunks split into parts; an engine in another namespace finds nothing.
- The remote backend built from a YAML configuration alone (``remote_storage_plugins`` + ``extra_config``,
  the address from ``TENSORCAST_ADDRESS``): batched put, lookup, get, LMCache's async lookup and get, ping;
  a key longer than a page key allows. Options are checked (unknown ones, a bad namespace or page size).
- Pages that are not what they claim (garbage, a flipped byte, a page copied under another key, a
  header whose layout does not match its length, a missing or oversized tail) are misses, while the good
  chunks of the same batch are hits. A chunk another writer stored meanwhile with other bytes stays
  theirs and does not fail the rest of its batch (same host, and over the network).
- The multi-process mode L2 adapter through LMCache's ``StorageManager``: store, evict from L1, prefetch
  back from L2 byte for byte, in the same and in a fresh storage manager; a buffer of another layout is no
  hit.

CI installs LMCache in its own environment with ``.ci/install-lmcache.sh`` (its pins differ from the other
engines'); without it this module is skipped.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("lmcache", reason="needs LMCache (installed by .ci/install-lmcache.sh)")

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.distributed.api import GroupedObjectKeys, MemoryLayoutDesc, ObjectKey, PrefetchTaskSpec
from lmcache.v1.distributed.config import parse_args
from lmcache.v1.distributed.storage_manager import StorageManager
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend import CreateStorageBackends

import tensorcast as tc
from tensorcast.errors import InvalidArgument
from tensorcast.integrations.lmcache import (
    ChunkMeta,
    ChunkPages,
    TensorCastConnector,
    connect_pages,
    encode_chunk,
    options_of,
)
from tensorcast.integrations.lmcache_l2 import TensorCastL2Adapter, TensorCastL2AdapterConfig, object_name
from tensorcast.testing import running_cluster, wait_shards_settled

PLUGIN = "remote_storage_plugin.tensorcast."
LAYERS, HEADS, DIM, CHUNK = 2, 4, 32, 64  # one chunk: 2 x 2 layers x 64 tokens x 128 x fp16 = 64 KiB


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Any, tc.Client]]:
    with running_cluster(workers=2) as c, tc.connect(c.address) as client:
        wait_shards_settled(client, set(c.worker_ids))
        yield c, client


def _wait(check: Callable[[], bool], what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# ----------------------------------------------------------------- (a) two engines
class CPUConnector(GPUConnectorInterface):  # type: ignore[misc]
    """The engine's KV as one CPU tensor ``kv[2, layers, tokens, heads * dim]`` (LMCache's KV_2LTD)."""

    def __init__(self, kv: torch.Tensor) -> None:
        self.kv = kv

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        memory_obj.tensor.copy_(self.kv[:, :, start:end, :])

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        self.kv[:, :, start:end, :].copy_(memory_obj.tensor)

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for m, s, e in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(m, s, e)

    def batched_to_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for m, s, e in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(m, s, e)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, LAYERS, num_tokens, HEADS * DIM])


def _metadata(chunk: int = CHUNK, heads: int = HEADS, dim: int = DIM) -> LMCacheMetadata:
    return LMCacheMetadata(model_name="tiny", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=torch.float16, kv_shape=(LAYERS, 2, chunk, heads, dim), chunk_size=chunk,
                           role="worker")


def _engine_config(address: str, **options: Any) -> LMCacheEngineConfig:
    extra = {PLUGIN + "module_path": "tensorcast.integrations.lmcache", PLUGIN + "class_name": "TensorCastConnector",
             PLUGIN + "address": address, **{PLUGIN + k: v for k, v in options.items()}}
    return LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.05,
                                             remote_storage_plugins=["tensorcast"], extra_config=extra)


def _engine(name: str, config: LMCacheEngineConfig, kv: torch.Tensor) -> Any:
    engine = LMCacheEngineBuilder.get_or_create(name, config, _metadata(), CPUConnector(kv), lambda t, r: None,
                                                lambda o, r: o)
    engine.post_init()
    return engine


def _connector(backend: Any) -> TensorCastConnector:
    connector = backend.connection.getWrappedConnector()
    assert isinstance(connector, TensorCastConnector)
    return connector


@pytest.mark.parametrize("page", [None, 16384])  # a chunk in one page; in a head and 4 tails (64 KiB + header)
def test_a_second_engine_retrieves_what_the_first_stored(cluster: Any, page: int | None) -> None:
    c, client = cluster
    options = {"namespace": f"engines{page}"} | ({"max_page_bytes": page} if page else {})
    tokens = torch.arange(5000, 5000 + 3 * CHUNK)
    src = torch.randn(2, LAYERS, len(tokens), HEADS * DIM).half()
    a = _engine(f"A{page}", _engine_config(c.address, **options), src)
    try:
        connector = _connector(a.storage_manager.storage_backends["RemoteBackend-tensorcast"])
        keys = [connector.pages.key(k.to_string()) for _, _, k in a.token_database.process_tokens(tokens)]
        assert len(keys) == 3
        a.store(tokens)
        _wait(lambda: all(client.kv.present(keys)), "the stored chunks in the pool")
        assert [h.nbytes for h in client.kv.get(keys)] == [page or 64 * 1024 + 64] * 3  # heads: a page, or all
    finally:
        LMCacheEngineBuilder.destroy(f"A{page}")

    dst = torch.zeros_like(src)
    b = _engine(f"B{page}", _engine_config(c.address, **options), dst)
    try:
        assert b.lookup(tokens, lookup_id="r1", pin=True) == len(tokens)
        retrieved = b.retrieve(tokens, lookup_id="r1")
        b.lookup_unpin("r1")
        assert int(retrieved.sum()) == len(tokens)
        assert torch.equal(dst, src)
    finally:
        LMCacheEngineBuilder.destroy(f"B{page}")

    other = _engine(f"C{page}", _engine_config(c.address, namespace="elsewhere"), torch.zeros_like(src))
    try:
        assert other.lookup(tokens, lookup_id="r2", pin=False) == 0
    finally:
        LMCacheEngineBuilder.destroy(f"C{page}")


# ----------------------------------------------------------------- (b) configuration only
@pytest.fixture(scope="module")
def backends(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    c, _ = cluster
    path = tmp_path_factory.mktemp("lmcache") / "lmcache.yaml"
    path.write_text("chunk_size: 16\nlocal_cpu: true\nmax_local_cpu_size: 0.05\n"
                    'remote_storage_plugins: ["tensorcast"]\nextra_config:\n'
                    f"  {PLUGIN}module_path: tensorcast.integrations.lmcache\n"
                    f"  {PLUGIN}class_name: TensorCastConnector\n"
                    f"  {PLUGIN}namespace: configured\n")
    mp = pytest.MonkeyPatch()
    mp.setenv("TENSORCAST_ADDRESS", c.address)  # no address in the file
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    made = CreateStorageBackends(LMCacheEngineConfig.from_file(str(path)), _metadata(16, 2, 8), loop)
    try:
        yield made
    finally:
        for backend in made.values():
            backend.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        mp.undo()


def _filled(local: Any, seed: int, shape: tuple[int, ...] = (2, LAYERS, 16, 16)) -> Any:
    obj = local.allocate([torch.Size(shape)], [torch.float16])
    obj.tensor.copy_(torch.from_numpy(np.random.default_rng(seed).standard_normal(shape).astype(np.float16)))
    return obj


def _key(n: int, model: str = "tiny") -> CacheEngineKey:
    return CacheEngineKey(model, 1, 0, n, torch.float16)


def test_the_backend_is_made_from_configuration_alone(backends: dict[str, Any], cluster: Any) -> None:
    _, client = cluster
    remote, local = backends["RemoteBackend-tensorcast"], backends["LocalCPUBackend"]
    assert _connector(remote).pages.prefix == "lmc/configured/"
    keys = [_key(100 + i) for i in range(3)] + [_key(7, model="m" * 600)]  # the last key is hashed
    objs = [_filled(local, i) for i in range(len(keys))]
    expected = [o.tensor.clone() for o in objs]
    assert remote.batched_contains(keys) == 0
    remote.batched_submit_put_task(keys, objs)
    _wait(lambda: remote.batched_contains(keys) == len(keys), "the put to land")
    page_keys = [_connector(remote).pages.key(k.to_string()) for k in keys]
    assert all(client.kv.present(page_keys)) and all(len(k.encode()) <= 512 for k in page_keys)
    assert remote.contains(keys[1]) and not remote.contains(_key(999))
    assert remote.batched_contains([keys[0], _key(999), keys[2]]) == 1  # leading chunks only
    got = remote.batched_get_blocking(keys)
    assert all(torch.equal(g.tensor, e) for g, e in zip(got, expected, strict=True))
    assert remote.get_blocking(_key(999)) is None

    def on_loop(coro: Any) -> Any:  # LMCache's async paths (async loading, health checks) run on its loop
        return asyncio.run_coroutine_threadsafe(coro, remote.loop).result(10)

    assert on_loop(remote.batched_async_contains("l1", [keys[0], keys[1], _key(999)])) == 2
    leading = on_loop(remote.batched_get_non_blocking("l1", [keys[0], _key(999), keys[2]]))
    assert len(leading) == 1 and torch.equal(leading[0].tensor, expected[0])
    assert on_loop(_connector(remote).ping()) == 0
    for o in [*objs, *got, *leading]:
        o.ref_count_down()


def test_options_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TENSORCAST_ADDRESS", raising=False)
    ours = {PLUGIN + "module_path": "tensorcast.integrations.lmcache", PLUGIN + "class_name": "TensorCastConnector"}
    other = {"remote_storage_plugin.fs.module_path": "elsewhere", "remote_storage_plugin.fs.ttl": "1"}
    assert options_of({**ours, **other, PLUGIN + "ttl": 60}, ["fs", "tensorcast"], "TensorCastConnector") == \
        {**{k.removeprefix(PLUGIN): v for k, v in ours.items()}, "ttl": 60}
    with pytest.raises(InvalidArgument, match="adress"):
        options_of({**ours, PLUGIN + "adress": "h:1"}, ["tensorcast"], "TensorCastConnector")
    with pytest.raises(InvalidArgument, match="address"):
        connect_pages({}, "lmc")
    with pytest.raises(InvalidArgument, match="namespace"):
        connect_pages({"address": "h:1", "namespace": "a/b"}, "lmc")
    with pytest.raises(InvalidArgument, match="max_page_bytes"):
        connect_pages({"address": "h:1", "max_page_bytes": 100}, "lmc")
    with pytest.raises(ValueError, match="adress"):
        TensorCastL2AdapterConfig.from_dict({"adress": "h:1"})


# ----------------------------------------------------------------- (c) pages that are not what they claim
def _pages(name: str, obj: Any, max_page: int, meta: ChunkMeta | None = None) -> list[tuple[str, Any]]:
    data = memoryview(obj.byte_array).cast("B")
    return encode_chunk(name, data, meta or ChunkMeta.of(obj, len(data)), max_page)


def test_pages_that_do_not_check_out_are_misses(backends: dict[str, Any], cluster: Any) -> None:
    _, client = cluster
    remote, local = backends["RemoteBackend-tensorcast"], backends["LocalCPUBackend"]
    pages = _connector(remote).pages
    big = (2, LAYERS, 64, 16)  # 8 KiB: a head and 2 tails of 4 KiB pages
    keys = [_key(200 + i) for i in range(8)]
    names = [pages.key(k.to_string()) for k in keys]
    good, split, flipped, copied, lying, no_tail, fat_tail = (_filled(local, 20 + i, big) for i in range(7))

    def put(page_list: list[tuple[str, Any]]) -> None:
        client.kv.put([k for k, _ in page_list], [p for _, p in page_list])

    put(_pages(names[0], good, 4096))
    put([(names[1], np.random.default_rng(1).integers(0, 256, 3000, dtype=np.uint8))])  # garbage
    bad = _pages(names[2], flipped, 4096)
    bad[1][1][100] ^= 1  # one bit of a tail (a view of the chunk)
    put(bad)
    put([(names[3] + k.removeprefix(names[7]), p) for k, p in _pages(names[7], copied, 4096)])  # another key's
    wrong = ChunkMeta(1, lying.get_size(), int(lying.get_memory_format().value), [[2, LAYERS, 32, 16]], ["float16"])
    put(_pages(names[4], lying, 4096, wrong))  # the header's layout is half the chunk's length
    put(_pages(names[5], no_tail, 4096)[:-1])
    fat = _pages(names[6], fat_tail, 4096)
    put([*fat[:-1], (fat[-1][0], np.zeros(4096, np.uint8))])  # the last tail is a whole page, not 2048 B
    put(_pages(pages.key(_key(300).to_string()), split, 4096))

    assert remote.batched_contains(keys[:7]) == 7  # a lookup sees heads; the bytes are judged on reading
    got = remote.batched_get_blocking([*keys[:7], _key(300)])
    assert torch.equal(got[0].tensor, good.tensor) and torch.equal(got[7].tensor, split.tensor)
    assert [g is None for g in got] == [False] + [True] * 6 + [False]
    for o in [good, split, flipped, copied, lying, no_tail, fat_tail, got[0], got[7]]:
        o.ref_count_down()


class _Late:
    """A client whose lookups see nothing yet: chunks another writer stores meanwhile meet the put itself."""

    def __init__(self, client: tc.Client) -> None:
        self.real = client.kv

    @property
    def kv(self) -> _Late:
        return self

    def present(self, keys: list[str]) -> list[bool]:
        return [False] * len(keys)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


@pytest.mark.parametrize("host", ["same", "another"])  # pages mapped on this host; every byte over the network
def test_a_chunk_held_with_other_bytes_does_not_fail_its_batch(backends: dict[str, Any], cluster: Any,
                                                                host: str) -> None:
    c, _ = cluster
    local = backends["LocalCPUBackend"]
    config = tc.Config.from_flat({"client.host_id": "another-host"}) if host == "another" else None
    with tc.connect(c.address, config=config) as writer:
        pages = ChunkPages(_Late(writer), f"lmc/conflict-{host}/", ttl=None, max_page_bytes=4096)
        ours = [_filled(local, 40 + i, (2, LAYERS, 64, 16)) for i in range(3)]
        theirs = _filled(local, 50, (2, LAYERS, 64, 16))
        names = [f"chunk{i}" for i in range(3)]
        ChunkPages(writer, pages.prefix, ttl=None, max_page_bytes=4096).store(names[1:2], [theirs])
        assert pages.store(names, ours) == [0, 1, 2]

        def into(i: int, meta: ChunkMeta) -> tuple[Any, memoryview]:
            obj = local.allocate([torch.Size(meta.shapes[0])], [torch.float16])
            return obj, memoryview(obj.byte_array).cast("B")

        got = pages.load(names, into, lambda o: o.ref_count_down())
    assert [torch.equal(g.tensor, o.tensor) for g, o in zip(got, [ours[0], theirs, ours[2]], strict=True)] == [True] * 3
    for o in [*ours, theirs, *got]:
        o.ref_count_down()


# ----------------------------------------------------------------- (d) multi-process mode, L2
def _storage_manager(address: str) -> StorageManager:
    spec = {"type": "plugin", "module_path": "tensorcast.integrations.lmcache_l2",
            "class_name": "TensorCastL2Adapter",
            "adapter_params": {"address": address, "namespace": "l2test", "max_page_bytes": 16384}}
    return StorageManager(parse_args(["--l1-size-gb", "0.05", "--eviction-policy", "LRU",
                                      "--l2-adapter", json.dumps(spec)]))


def _prefetch(sm: StorageManager, keys: list[ObjectKey], layout: MemoryLayoutDesc) -> Any:
    handle = sm.submit_prefetch_task(PrefetchTaskSpec(key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0,
                                                                                    layout_desc=layout)]))
    assert sm.wait_prefetch_status(handle, 20)
    return sm.query_prefetch_status(handle)


def _prefetched_from_l2(sm: StorageManager, keys: list[ObjectKey], layout: MemoryLayoutDesc,
                        expected: dict[Any, torch.Tensor]) -> None:
    """Every key prefetched from the L2 (the pool), byte-exact."""
    res = _prefetch(sm, keys, layout)
    assert [b.popcount() for b in res.l2_hit_cells] == [len(keys)]
    with sm.read_prefetched_results(keys, res.l1_owners or None) as got:
        assert all(torch.equal(o.tensor, expected[k]) for k, o in zip(keys, got, strict=True))
    sm.finish_read_prefetched(keys, l1_owners=res.l1_owners or None)


def test_l2_adapter_stores_and_prefetches_through_the_storage_manager(cluster: Any) -> None:
    c, client = cluster
    layout = MemoryLayoutDesc(shapes=[torch.Size([2, LAYERS, CHUNK, HEADS * DIM])], dtypes=[torch.float16])
    keys = [ObjectKey(chunk_hash=bytes([i]) * 16, model_name="tiny", kv_rank=0) for i in range(3)]
    sm = _storage_manager(c.address)
    try:
        ((_, adapter),) = sm.l2_adapters()
        assert isinstance(adapter, TensorCastL2Adapter)
        objs = sm.reserve_write(keys, layout)
        expected = {}
        for k, o in objs.items():
            o.tensor.copy_(torch.randn(o.tensor.shape).half())
            expected[k] = o.tensor.clone()
        sm.finish_write(keys)
        names = [adapter.pages.key(object_name(k)) for k in keys]
        _wait(lambda: all(client.kv.present(names)), "the L2 store")
        assert [h.nbytes for h in client.kv.get(names)] == [16384] * 3  # each in a head and tails
        assert sm.delete_l1_keys(keys, force=True)[0] == 3
        _prefetched_from_l2(sm, keys, layout, expected)
    finally:
        sm.close()

    fresh = _storage_manager(c.address)  # another server: nothing in its L1, the pool has it all
    try:
        other = MemoryLayoutDesc(shapes=[torch.Size([2, LAYERS, CHUNK, HEADS * DIM])], dtypes=[torch.bfloat16])
        assert [b.popcount() for b in _prefetch(fresh, keys, other).hit_cells] == [0]  # stored as float16
        _prefetched_from_l2(fresh, keys, layout, expected)
    finally:
        fresh.close()

