"""The HF transformers adaptor across real instance processes on two workers."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import tensorcast as tc
from tensorcast.cluster import LocalCluster
from tensorcast.testing import running_cluster

PROMPT = [int(t) for t in np.random.default_rng(7).integers(0, 256, 40)]


@pytest.fixture(scope="module")
def engines() -> Iterator[LocalCluster]:
    with running_cluster(workers=3) as cluster:
        cluster.start_instance("inst-a", "w0", ["--seed", "0"])
        cluster.start_instance("inst-b", "w1", ["--seed", "0"])
        cluster.start_instance("inst-c", "w1", ["--seed", "1"])  # different weights
        yield cluster


def _engine(c: tc.Client, inst: str, command: str, **args: object) -> dict:
    return c.call_instance(inst, "engine", args={"command": command, **args}).result


def test_publish_prefetch_hydrate_continues_exactly_like_recompute(engines: LocalCluster) -> None:
    with tc.connect(engines.workers["w2"].address) as c:  # a gateway that holds neither instance
        _engine(c, "inst-a", "prefill", request_id="req-1", input_ids=PROMPT)
        plan = c.plan(ctx=tc.context(timeout=60, idempotency_key="hf-migrate-1"))
        pub = plan.publish(instance="inst-a", request_id="req-1")
        pre = plan.prefetch(pub.output, to="w1")
        plan.hydrate(instance="inst-b", request_id="req-1", artifacts=pub.output, after=[pre])
        outcome = plan.run(concurrency=4).result(timeout=60)
        assert outcome.ok, outcome.steps
        kv = c.artifact(outcome.output(pub)[0])
        assert kv.owner == "lease" and {r.worker_id for r in kv.replicas} >= {"w0", "w1"}

        migrated = np.array(_engine(c, "inst-b", "next_logits", request_id="req-1")["logits"])
        recomputed = np.array(_engine(c, "inst-b", "prefill", request_id="ref-1", input_ids=PROMPT)["logits"])
        original = np.array(_engine(c, "inst-a", "next_logits", request_id="req-1")["logits"])
        np.testing.assert_allclose(migrated, recomputed, atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(migrated, original, atol=1e-4, rtol=1e-4)
        cont = _engine(c, "inst-b", "generate", request_id="req-1", max_new_tokens=10)["tokens"]
        ref = _engine(c, "inst-b", "generate", request_id="ref-1", max_new_tokens=10)["tokens"]
        assert cont == ref

        # Publishing the same request again is the same artifact (idempotent by content).
        again = c.call_instance("inst-a", "publish", request_id="req-1").artifacts
        assert again == outcome.output(pub)


def test_transform_into_fills_parameters_in_place(engines: LocalCluster) -> None:
    from tensorcast.instance.hf import tiny_llama

    with tc.connect(engines.address) as c:
        a = np.array(_engine(c, "inst-a", "prefill", request_id="w-a", input_ids=PROMPT)["logits"])
        c_before = np.array(_engine(c, "inst-c", "prefill", request_id="w-c0", input_ids=PROMPT)["logits"])
        assert not np.allclose(a, c_before, atol=1e-3)  # different seeds, different weights
        weights = c.put(tiny_llama(0).state_dict(), key="weights/tiny@v0", policy="durable")
        plan = c.plan(ctx=tc.context(timeout=60))
        plan.transform_into(instance="inst-c", artifacts=weights)
        assert plan.run().result(timeout=60).ok
        c_after = np.array(_engine(c, "inst-c", "prefill", request_id="w-c1", input_ids=PROMPT)["logits"])
        np.testing.assert_allclose(c_after, a, atol=1e-5, rtol=1e-5)


def test_instance_signals(engines: LocalCluster) -> None:
    with tc.connect(engines.address) as c:
        _engine(c, "inst-c", "prefill", request_id="sig", input_ids=PROMPT)
        deadline = time.time() + 5
        while time.time() < deadline:
            inst = {i.instance_id: i for i in c.list_instances()}
            if inst["inst-c"].kv_tokens_used >= len(PROMPT):
                break
            time.sleep(0.1)
        assert inst["inst-a"].home_worker == "w0" and inst["inst-c"].home_worker == "w1"
        assert all(i.alive and i.engine == "transformers" for i in inst.values())
        assert inst["inst-c"].running >= 1 and inst["inst-c"].kv_tokens_used >= len(PROMPT)
        workers = c.list_workers()
        assert all(w.net_in_bps >= 0 and w.net_out_bps >= 0 and w.transfers_in_flight >= 0 for w in workers)
        with pytest.raises(tc.errors.InvalidArgument):
            _engine(c, "inst-a", "teleport")


def test_migrate_example_runs() -> None:
    example = Path(__file__).parents[2] / "examples" / "migrate_request.py"
    r = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "same continuation" in r.stdout
