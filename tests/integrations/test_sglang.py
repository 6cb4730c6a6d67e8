"""SGLang 0.5.23's HiCache storage (L3) on TensorCast, through SGLang's own classes on CPU.

CI installs SGLang with ``.ci/install-sglang.sh``; without it this module is skipped with that reason. SGLang
is never imported in this (shared) pytest process: importing it patches transformers process-wide. Every
SGLang run is a subprocess with ``sglang_stubs/`` on ``PYTHONPATH``: a torchvision stand-in (SGLang imports
torchvision at module level; the PyPI build is CUDA-only) and the helpers below.

- SGLang's own tests of its bundled ``tensorcast`` backend (shipped in the wheel beside it) run unmodified
  against this package's ``tensorcast.api.store``.
- Two instances, each its own process with SGLang's real host pool and ``HiCacheController``: A backs pages
  up, B finds the prefix, has the controller transfer it and holds A's exact bytes; for this package's
  backend (zero-copy and legacy calls) and for SGLang's bundled one (allocator mode in A, scratch in B).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tensorcast.testing import running_cluster

if importlib.util.find_spec("sglang") is None:
    pytest.skip("needs sglang 0.5.23 (installed by .ci/install-sglang.sh)", allow_module_level=True)

STUBS = Path(__file__).with_name("sglang_stubs")
UPSTREAM_TESTS = ["sglang.srt.mem_cache.storage.tensorcast_store.test_tensorcast_store",
                  "sglang.srt.mem_cache.storage.tensorcast_store.test_tensorcast_host_allocator"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(STUBS), env.get("PYTHONPATH", "")) if p)
    env.pop("TENSORCAST_ADDRESS", None)  # the instances must use the address they are given
    return env


@pytest.mark.timeout(1200)  # its host-allocator tests start fresh interpreters that import SGLang: minutes here
def test_sglang_own_tensorcast_store_tests_pass(tmp_path: Path) -> None:
    # Run from an empty folder, so that neither this repository's pytest configuration nor its conftest applies.
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "sglang_single_rank",
                        "--pyargs", *UPSTREAM_TESTS], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                       timeout=1100)
    summary = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) > 0 and "failed" not in summary and "error" not in summary, summary


def _instance(role: str, address: str, out: Path) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-m", "sglang_hicache_instance", role, address, str(out)], cwd=out,
                       env=_env(), capture_output=True, text=True, timeout=900)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert r.returncode == 0 and line is not None, r.stdout[-4000:] + r.stderr[-6000:]
    result: dict[str, Any] = json.loads(line[len("RESULT "):])
    return result


@pytest.mark.timeout(1200)  # two processes import SGLang in turn
def test_two_instances_share_kv_pages_through_hicache(tmp_path: Path) -> None:
    with running_cluster(workers=2) as cluster:
        a = _instance("a", cluster.address, tmp_path)
        b = _instance("b", cluster.address, tmp_path)
    tokens = a["page"] * a["pages"]
    pages = {name: np.load(tmp_path / f"{name}.npy") for name in ("a_ours", "b_ours", "b_legacy", "a_upstream",
                                                                  "b_upstream")}

    # This package's backend: A stored every page; B's hit query found exactly them (not the two unknown
    # pages after them), the controller loaded them, and B's host pool holds A's bytes.
    assert a["ours_backed_up"] == tokens
    assert b["ours_hit"] == b["ours_loaded"] == tokens
    assert pages["a_ours"].shape == (a["pages"], pages["a_ours"].shape[1])
    assert np.array_equal(pages["b_ours"], pages["a_ours"])
    assert b["ours_unknown_hit"] == 0 and b["other_model_hit"] == 0
    assert b["ours_stats_pages"] == [a["pages"]] and b["ours_stats_after"] == []  # get_stats drains
    assert b["ours_hit_after_clear"] == 0
    # SGLang's legacy (non-zero-copy) calls read the pages the zero-copy calls wrote: same page format.
    assert b["legacy_zero_copy"] is False and b["legacy_loaded"] == tokens
    assert np.array_equal(pages["b_legacy"], pages["a_ours"])

    # SGLang's bundled backend on tensorcast.api.store: A in allocator mode (its host pool is a session
    # region), B in scratch mode; B reads A's fragments exactly.
    assert a["upstream_allocator"] == "TensorcastHostTensorAllocator" and a["upstream_region"]
    assert a["upstream_backed_up"] == tokens and a["upstream_session_stats"]["puts"] == 2 * a["pages"]
    assert b["upstream_hit"] == b["upstream_loaded"] == tokens
    assert np.array_equal(pages["b_upstream"], pages["a_upstream"])
    assert not np.array_equal(pages["a_upstream"], pages["a_ours"])  # two backends, two seeds: no mix-up
