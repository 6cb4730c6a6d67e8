"""The ranks of a tensor-parallel vLLM engine agree on a failed update (``TensorCastWeightTransferEngine._agree``):
vLLM's multiprocess executor stops at the first failed rank's answer and leaves the others' to be taken for the
next call's, so every rank drops what it staged and only the last one raises, naming the rank that failed. Two
real processes in a gloo group stand for the ranks (no vLLM needed: the engine class is used without it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

RANK = r"""
import json, sys
import torch.distributed as dist
import tensorcast.integrations.vllm_transfer as vt
from tensorcast.errors import NotFound

rank, store, fail = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
vt._engine_ranks = lambda: (dist.group.WORLD, rank, 2)
engine = object.__new__(vt.TensorCastWeightTransferEngine)
engine._staged = "a staged version"
try:
    engine._agree(NotFound("no artifact with key 'policy@v99'") if rank in fail else None)
    out = {"raised": None}
except Exception as exc:
    out = {"raised": type(exc).__name__, "message": str(exc)}
out["staged"] = engine._staged
print("RESULT " + json.dumps(out), flush=True)
dist.destroy_process_group()
"""


def ranks(tmp_path: Path, fail: list[int]) -> list[dict[str, object]]:
    store = tmp_path / f"store-{'-'.join(map(str, fail)) or 'none'}"
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(store), json.dumps(fail)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        line = next((x for x in stdout.splitlines() if x.startswith("RESULT ")), None)
        assert line is not None, stderr[-2000:]
        out.append(json.loads(line[len("RESULT "):]))
    return out


def test_one_rank_fails_the_last_one_answers(tmp_path: Path) -> None:
    first, last = ranks(tmp_path, [0])
    assert first == {"raised": None, "staged": None}  # rank 0 failed, but answers "done": vLLM reads it first
    assert last["raised"] == "InvalidArgument" and "rank 0" in str(last["message"]) and "v99" in str(last["message"])
    assert last["staged"] is None  # rank 1 staged, and dropped it: the model is unchanged everywhere


def test_every_rank_fails_the_last_one_raises_its_own_error(tmp_path: Path) -> None:
    first, last = ranks(tmp_path, [0, 1])
    assert first["raised"] is None and last["raised"] == "NotFound"


def test_all_ranks_staged_nobody_raises(tmp_path: Path) -> None:
    assert ranks(tmp_path, []) == [{"raised": None, "staged": "a staged version"}] * 2
