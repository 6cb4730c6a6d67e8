"""Content trust on one worker, in process over real memory and disk tiers: bytes a same-host caller wrote and
stated the digest of are never deduplicated onto, or handed out, before they are checked; a blob that fails
is dropped (its pages never reused), and the next put of that content stores its own bytes."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tensorcast.client.puts import _write_segments
from tensorcast.client.write_maps import SegmentWriter
from tensorcast.config import Config
from tensorcast.errors import NotFound
from tensorcast.obs import metrics
from tensorcast.pool.placement import PRESETS
from tensorcast.records import Placement
from tensorcast.tensors import TensorInput, normalize_tensors
from tensorcast.wire.messages import DataRequest, PutBegin
from tensorcast.worker.puts import PutManager
from tensorcast.worker.store import LocalStore
from tensorcast.worker.trust import BlobTrust

MiB = 1 << 20


async def _gone(artifact_id: str, tier: str) -> None:
    GONE.append((artifact_id, tier))


GONE: list[tuple[str, str]] = []


@pytest.fixture()
def puts(tmp_path: Path) -> Iterator[PutManager]:
    cfg = Config.from_flat({"worker.memory_capacity": 64 * MiB, "worker.prefault_bytes": 0,
                            "worker.shm_prefix": f"tc-test-{uuid.uuid4().hex[:8]}",
                            "worker.disk_dir": str(tmp_path / "disk")})
    store = LocalStore(cfg.worker, "w", _gone)
    GONE.clear()
    yield PutManager(cfg.worker, store, BlobTrust(store))
    store.close()


def _x(seed: int = 1, n: int = 2 * MiB) -> list[TensorInput]:
    return normalize_tensors({"w": np.random.default_rng(seed).integers(0, 255, n, dtype=np.uint8)})


def _mismatches() -> float:
    family = next(f for f in metrics.REGISTRY.collect() if f.name == "tensorcast_blob_verifications")
    return sum(s.value for s in family.samples if s.labels.get("result") == "mismatch" and s.name.endswith("_total"))


def _put(puts: PutManager, inputs: list[TensorInput], placement: Placement = PRESETS["cache"], *,
         write: bool = True, later: tuple[str, ...] | None = None) -> str:
    """A same-host put; ``write=False``: the caller states the digests but writes nothing (zeros stay);
    ``later``: begun with digests_later, these digests stated at the commit."""
    if later is None:
        msg = PutBegin(tensors=tuple(t.meta for t in inputs), same_host=True)
    else:
        msg = PutBegin(tensors=tuple(t.meta_without_digest() for t in inputs), same_host=True, digests_later=True)
    plan = asyncio.run(puts.begin(msg, placement))
    if write and not plan.exists:
        _write_segments(writer := SegmentWriter(), plan, inputs)
        writer.close()
    return asyncio.run(puts.commit(plan.put_id, later or ())).artifact_id


def _held(puts: PutManager, inputs: list[TensorInput]) -> bytes:
    return bytes(puts.store.memory.blob(inputs[0].meta.digest).view())


def test_a_put_never_deduplicates_onto_bytes_a_liar_wrote(puts: PutManager) -> None:
    x, memory = _x(), puts.store.memory
    before = _mismatches()
    aid = _put(puts, x, write=False)  # states X's digest, leaves zeros
    assert memory.is_unverified(x[0].meta.digest) and _held(puts, x) != x[0].data.tobytes()
    assert _put(puts, x) == aid  # the honest put: the held blob fails its check, is dropped, X is written afresh
    assert _held(puts, x) == x[0].data.tobytes() and memory.has_replica(aid)
    assert (aid, "memory") in GONE and _mismatches() == before + 1
    assert memory.state.used == 2 * MiB and memory.state.reserved == 0


def test_wrong_digests_at_a_digests_later_commit_are_caught_by_the_next_put(puts: PutManager) -> None:
    x = _x(2, 6 * MiB)
    zeros = normalize_tensors({"w": np.zeros(6 * MiB, np.uint8)})
    aid = _put(puts, zeros, later=(x[0].meta.digest,))  # zeros written, X's digest stated at the commit
    assert _held(puts, x) != x[0].data.tobytes()
    assert _put(puts, x, later=(x[0].meta.digest,)) == aid  # honest, digests later: the held blob is checked
    assert _held(puts, x) == x[0].data.tobytes()
    assert puts.store.memory.state.used == 6 * MiB and puts.store.memory.state.reserved == 0


def test_an_honest_blob_checked_once_then_trusted(puts: PutManager) -> None:
    x, memory = _x(3), puts.store.memory
    aid = _put(puts, x)
    assert memory.is_unverified(x[0].meta.digest)
    before = _mismatches()
    assert _put(puts, x, write=False) == aid  # a liar stating X's digest again deduplicates onto checked bytes
    assert memory.is_verified(x[0].meta.digest) and _held(puts, x) == x[0].data.tobytes()
    assert _mismatches() == before and not GONE


def test_verified_puts_and_inline_puts_are_trusted_at_once(puts: PutManager) -> None:
    x = _x(4)
    puts.config = Config.from_flat({"worker.verify_local_puts": True}).worker
    _put(puts, x)
    assert puts.store.memory.is_verified(x[0].meta.digest)


def test_a_disk_copy_is_checked_and_a_bad_one_replaced(puts: PutManager) -> None:
    x = _x(5)
    disk = puts.store.disk
    assert disk is not None
    spill = Placement(memory="none", disk="required")  # disk targets, written by the caller
    aid = _put(puts, x, spill, write=False)
    d = x[0].meta.digest
    assert disk.is_unverified(d) and disk.has_artifact(aid)
    assert _put(puts, x, spill) == aid  # checked at PutBegin: dropped, written afresh
    assert Path(disk.blob_path(d)).read_bytes() == x[0].data.tobytes()
    # A durable put copies its memory blob to disk: a bad blob file there is replaced, not trusted.
    y = _x(6)
    _put(puts, y, spill, write=False)
    before = _mismatches()
    _put(puts, y, PRESETS["durable"])
    assert Path(disk.blob_path(y[0].meta.digest)).read_bytes() == y[0].data.tobytes()
    assert _mismatches() >= before + 1


def test_reads_are_served_only_from_checked_bytes(puts: PutManager) -> None:
    x = _x(7)
    trust = puts.trust
    aid = _put(puts, x, write=False)

    async def serve() -> None:
        trust.start(asyncio.get_running_loop())
        with pytest.raises(NotFound, match="digest check"):
            trust.check_read(DataRequest(artifact_id=aid, name="w"))
        await asyncio.sleep(0.05)  # the condemnation runs on the loop

    asyncio.run(serve())
    assert not puts.store.memory.has_replica(aid) and not puts.store.memory.has_blob(x[0].meta.digest)
    good = _put(puts, x)
    asyncio.run(trust.ensure_read(good, ["w"], ""))  # checked: it matches, so it is served
    assert puts.store.memory.is_verified(x[0].meta.digest)


def test_the_idle_verifier_is_bounded_and_finds_bad_blobs(puts: PutManager) -> None:
    good, bad = _x(8), _x(9)
    _put(puts, good)
    _put(puts, bad, write=False)
    trust = puts.trust
    assert trust.verify_idle(10 * MiB, busy=lambda: True) == []  # busy: nothing checked
    assert puts.store.memory.is_unverified(good[0].meta.digest)
    found = trust.verify_idle(10 * MiB, busy=lambda: False)
    assert found == [("memory", bad[0].meta.digest)] and puts.store.memory.is_verified(good[0].meta.digest)
    asyncio.run(trust.condemn(found[0], "idle"))
    assert not puts.store.memory.has_blob(bad[0].meta.digest)


def test_a_condemned_blobs_pages_never_go_back_to_the_stock(tmp_path: Path) -> None:
    cfg = Config.from_flat({"worker.memory_capacity": 64 * MiB, "worker.prefault_bytes": 8 * MiB,
                            "worker.prefault_chunk_bytes": 4 * MiB,
                            "worker.shm_prefix": f"tc-test-{uuid.uuid4().hex[:8]}"})
    store = LocalStore(cfg.worker, "w", _gone)
    try:
        puts = PutManager(cfg.worker, store, BlobTrust(store))
        store.memory.stock.refill(lambda: False)
        x = _x(10, MiB)
        _put(puts, x, write=False)
        seg = store.memory.blob(x[0].meta.digest).segment
        stocked = store.memory.stock.ready_bytes
        _put(puts, x)  # condemns the liar's blob, alone in its chunk
        assert seg.exported and store.memory.stock.ready_bytes <= stocked  # unlinked, not recycled
    finally:
        store.close()


def test_disk_blobs_stay_checked_or_unchecked_across_a_restart(puts: PutManager) -> None:
    from tensorcast.pool.disk import DiskTier

    disk = puts.store.disk
    assert disk is not None
    spill = Placement(memory="none", disk="required")
    good, unchecked = _x(11), _x(12)
    _put(puts, good, spill)
    assert disk.check(good[0].meta.digest)
    _put(puts, unchecked, spill)
    again = DiskTier(disk.dir, disk.capacity)  # what a restarted worker finds
    assert again.is_verified(good[0].meta.digest) and again.is_unverified(unchecked[0].meta.digest)
    assert again.check(unchecked[0].meta.digest) and DiskTier(disk.dir, disk.capacity).is_verified(
        unchecked[0].meta.digest)
