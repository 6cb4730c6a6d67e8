"""The pure layout rules of Distributed Checkpoints in TensorCast (no processes)."""

from __future__ import annotations

from tensorcast.integrations.torch_dcp_layout import (
    CheckpointEntry,
    collectable,
    is_bundle_member,
    item_name,
    memory_first,
    rank_key,
    read_rounds,
    read_slices,
    run_prefix,
    writer_worker,
)
from tensorcast.pool.placement import PRESETS
from tensorcast.records import WorkerInfo


def test_names_and_keys() -> None:
    assert item_name("model.w", None) == "model.w"
    assert item_name("model.w", (4, 0)) == "model.w@4,0"
    assert rank_key("run7/step-1200", 3) == "run7/step-1200/.rank-00003"
    assert is_bundle_member(rank_key("a", 0)) and not is_bundle_member("run7/step-1200")
    assert run_prefix("run7/step-1200") == "run7/" and run_prefix("step-1") == ""


def test_read_slices_leave_whole_dimensions_out() -> None:
    assert read_slices((8, 6), (0, 0), (8, 6)) == []
    assert read_slices((8, 6), (2, 0), (3, 6)) == [(0, slice(2, 5))]
    assert read_slices((8, 6), (0, 3), (8, 3)) == [(1, slice(3, 6))]


def test_read_rounds_name_each_tensor_once() -> None:
    assert read_rounds(["a", "b", "a", "a", "c"]) == [[0, 1, 4], [2], [3]]


def test_memory_first_defers_only_the_disk_copy() -> None:
    staged = memory_first(PRESETS["ha"])
    assert staged is not None and staged.disk == "none" and staged.replicas == 2
    assert memory_first(PRESETS["cache"]) is None


def test_writer_worker_stays_on_its_host_and_spreads_by_rank() -> None:
    workers = [WorkerInfo(worker_id=w, address="", host_id=h, roles=()) for w, h in
               [("w0", "h1"), ("w1", "h2"), ("w2", "h1")]]
    assert [writer_worker(workers, "h1", r) for r in range(3)] == ["w0", "w2", "w0"]
    assert writer_worker(workers, "elsewhere", 0) is None


def test_keep_last_spares_the_newest_and_those_being_read() -> None:
    entries = [CheckpointEntry(f"r/step-{i}", float(i), reading=i == 2) for i in (10, 2, 3, 4)]
    assert collectable(entries, 2) == ["r/step-3"]
    assert collectable(entries, 10) == []
