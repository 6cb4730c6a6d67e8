"""Batched parallel reads of checkpoint byte ranges (``weights.reader``)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from tensorcast.errors import InvalidArgument, NotFound
from tensorcast.records import SliceSpec
from tensorcast.views import apply_slices
from tensorcast.weights.reader import ReadJob, SliceJob, read_ranges


def test_a_batch_over_several_files_lands_byte_exact(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    files = []
    for i in range(3):
        data = rng.integers(0, 256, 100_000 + i * 7919, dtype=np.uint8)
        (tmp_path / f"f{i}").write_bytes(data.tobytes())
        files.append(data)
    jobs, dests, want = [], [], []
    for i, data in enumerate(files):
        for start, end in ((0, 10), (17, 50_001), (len(data) - 999, len(data))):
            dest = np.zeros(end - start, np.uint8)
            jobs.append(ReadJob(str(tmp_path / f"f{i}"), start, memoryview(dest), f"t{i}.{start}"))
            dests.append(dest)
            want.append(data[start:end])
    # Chunks far smaller than the ranges: every range is cut into many pieces read by 3 threads.
    assert read_ranges(jobs, streams=3, chunk=4096) == sum(len(w) for w in want)
    for dest, expected in zip(dests, want, strict=True):
        assert np.array_equal(dest, expected)


def test_a_short_file_names_the_file_and_tensor(tmp_path: Path) -> None:
    (tmp_path / "short").write_bytes(b"x" * 1000)
    dest = np.zeros(2000, np.uint8)
    with pytest.raises(InvalidArgument, match=r"short.*'layer.0.w'.*truncated"):
        read_ranges([ReadJob(str(tmp_path / "short"), 0, memoryview(dest), "layer.0.w")], streams=4, chunk=256)
    with pytest.raises(NotFound, match="gone"):
        read_ranges([ReadJob(str(tmp_path / "missing"), 0, memoryview(dest))])


@pytest.mark.parametrize("shape,specs", [
    ((64, 48), [SliceSpec(dim=1, start=24, stop=48)]),  # row-parallel: half of every row, copied
    ((96, 16), [SliceSpec(dim=0, start=0, stop=96, ranges=((8, 16), (40, 48), (72, 80)))]),  # fused: runs
    ((64, 16), [SliceSpec(dim=0, start=1, stop=64, step=3)]),  # strided rows
    ((4, 32, 24), [SliceSpec(dim=1, start=16, stop=32)]),  # experts, split inside each
    ((4, 32, 24), [SliceSpec(dim=0, start=1, stop=3), SliceSpec(dim=2, start=0, stop=24, ranges=((0, 6), (12, 18)))]),
    ((7,), [SliceSpec(dim=0, start=2, stop=7, step=2)]),
])
def test_slices_land_exactly_as_numpy_slices_them(tmp_path: Path, shape: tuple[int, ...],
                                                  specs: list[SliceSpec]) -> None:
    rng = np.random.default_rng(1)
    tensor = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
    header = b"h" * 123  # tensors start anywhere in a file, not on a page
    (tmp_path / "ckpt").write_bytes(header + tensor.tobytes() + b"tail")
    want = apply_slices(tensor, specs)
    dest = np.zeros(want.shape, np.uint16)
    job = SliceJob(str(tmp_path / "ckpt"), len(header), "bfloat16", shape, tuple(specs),
                   memoryview(dest).cast("B"), "w")
    # A few output rows per piece: every slice is cut into several pieces run by 3 threads.
    assert read_ranges([job], streams=3, chunk=3 * 2 * 24) == want.nbytes
    assert np.array_equal(dest, want)


def test_reads_and_slice_copies_share_one_batch(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    a, b = rng.integers(0, 255, (128, 256), dtype=np.uint8), rng.integers(0, 255, (256, 128), dtype=np.uint8)
    (tmp_path / "ckpt").write_bytes(a.tobytes() + b.tobytes())
    da, db = np.zeros((64, 256), np.uint8), np.zeros((256, 64), np.uint8)
    jobs = [ReadJob(str(tmp_path / "ckpt"), 64 * 256, memoryview(da).cast("B"), "a"),
            SliceJob(str(tmp_path / "ckpt"), a.nbytes, "uint8", b.shape, (SliceSpec(dim=1, start=0, stop=64),),
                     memoryview(db).cast("B"), "b")]
    read_ranges(jobs, streams=2, chunk=1024)
    assert np.array_equal(da, a[64:]) and np.array_equal(db, b[:, :64])


def test_a_slice_of_a_truncated_file_names_the_file_and_tensor(tmp_path: Path) -> None:
    (tmp_path / "short").write_bytes(b"x" * 1000)
    dest = np.zeros((32, 16), np.uint8)
    job = SliceJob(str(tmp_path / "short"), 0, "uint8", (32, 32), (SliceSpec(dim=1, start=0, stop=16),),
                   memoryview(dest).cast("B"), "layer.0.o_proj")
    with pytest.raises(InvalidArgument, match=r"short.*'layer.0.o_proj'.*truncated"):
        read_ranges([job])


@pytest.mark.parametrize("max_gap", [0, 1 << 20])
def test_row_runs_land_exactly_with_and_without_the_discard_buffer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     max_gap: int) -> None:
    from tensorcast.weights import reader

    monkeypatch.setattr(reader, "_MAX_GAP", max_gap)  # 0: every gap is skipped by a read per row
    monkeypatch.setattr(reader, "_IOV_ROWS", 7)  # several preadv calls per block
    tensor = np.random.default_rng(3).integers(0, 255, (3, 50, 40), dtype=np.uint8)
    (tmp_path / "ckpt").write_bytes(b"h" * 17 + tensor.tobytes())
    for lo, hi in ((0, 10), (10, 30), (30, 40), (5, 5)):
        dest = np.zeros((3, 50, hi - lo), np.uint8)
        job = SliceJob(str(tmp_path / "ckpt"), 17, "uint8", tensor.shape, (SliceSpec(dim=2, start=lo, stop=hi),),
                       memoryview(dest.reshape(-1)), "w")
        read_ranges([job], streams=2, chunk=64)
        assert np.array_equal(dest, tensor[:, :, lo:hi]), (lo, hi)


def test_only_regular_files_are_read(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")  # no writer: a blocking open would never return
    (tmp_path / "link").symlink_to(tmp_path / "fifo")
    dest = np.zeros(16, np.uint8)
    for name in ("fifo", "link"):
        with pytest.raises(InvalidArgument, match=r"not a regular file|cannot be opened"):
            read_ranges([ReadJob(str(tmp_path / name), 0, memoryview(dest), "w")])
