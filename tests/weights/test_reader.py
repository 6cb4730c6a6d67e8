"""Batched parallel reads of checkpoint byte ranges (``weights.reader``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tensorcast.errors import InvalidArgument, NotFound
from tensorcast.weights.reader import ReadJob, read_ranges


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
