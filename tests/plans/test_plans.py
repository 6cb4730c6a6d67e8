"""Plans on real gateways: order and concurrency recorded, validation before anything runs, deadlines,
idempotent re-runs (same gateway from its record; another gateway after the first was killed)."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

import tensorcast as tc
from tensorcast.cluster import LocalCluster
from tensorcast.errors import DeadlineExceeded, InvalidArgument
from tensorcast.testing import running_cluster

MiB = 1 << 20


def _holders(client: tc.Client, aid: str) -> set[str]:
    return {r.worker_id for r in client.artifact(aid).replicas if r.tier == "memory"}


def test_fan_out_fan_in_runs_in_order_within_the_concurrency_limit(shared_cluster: LocalCluster) -> None:
    with tc.connect(shared_cluster.address) as c:
        art = c.put(np.random.default_rng(0).integers(0, 255, 2 * MiB, dtype=np.uint8), on="w0")
        plan = c.plan(ctx=tc.context(timeout=60))
        root = plan.wait(0.2, art)
        fan = [plan.wait(0.3, root.output) for _ in range(4)]
        pre = plan.prefetch(root.output, to="w1", after=fan[:2])
        join = plan.wait(0.1, pre.output, after=fan)
        plan.evict(join.output, on="w1")
        outcome = plan.run(concurrency=2).result(timeout=60)
        assert outcome.ok, outcome.steps
        steps = {s.id: s for s in outcome.steps}
        for spec in plan.steps:
            deps = set(spec.after) | ({spec.args["artifacts"]["$ref"]} if isinstance(spec.args.get("artifacts"), dict)
                                      else set())
            for d in deps:
                assert steps[d].finished <= steps[spec.id].started, f"{spec.id} started before {d} finished"
        events = sorted([(s.started, 1) for s in outcome.steps] + [(s.finished, -1) for s in outcome.steps])
        live = peak = 0
        for _, delta in events:
            live += delta
            peak = max(peak, live)
        assert peak == 2, f"observed {peak} concurrent steps with concurrency=2"
        assert outcome.output(pre) == (art.id,) and outcome[pre].result["bytes_moved"] == 2 * MiB
        assert _holders(c, art.id) == {"w0"}  # prefetched to w1, then evicted by the last step
        c.delete(art.id)


def test_bad_plans_are_refused_before_anything_runs(shared_cluster: LocalCluster) -> None:
    with tc.connect(shared_cluster.address) as c:
        art = c.put(np.arange(1000), on="w0")
        cases = []
        p = c.plan()
        p.prefetch(art, to="w1")
        p.prefetch(art, to="no-such-worker")
        cases.append((p, "unknown worker"))
        p = c.plan()
        a = p.prefetch(art, to="w1")
        b = p.wait(0.1, after=[a])
        a.after = (b.id,)
        cases.append((p, "cycle"))
        p = c.plan()
        p.prefetch(art, to="w1")
        p.publish(instance="no-such-instance", request_id="r")
        cases.append((p, "unknown instance"))
        p = c.plan()
        p.prefetch(art, to="w1")
        p.prefetch(["not-an-artifact-id"], to="w1")
        cases.append((p, "artifact id"))
        p = c.plan()
        p.prefetch(art, to="w1")
        p.wait(-3)
        cases.append((p, "seconds"))
        for plan, why in cases:
            with pytest.raises(InvalidArgument, match=why):
                plan.run().result(timeout=30)
        assert _holders(c, art.id) == {"w0"}, "a refused plan ran a step"
        c.delete(art.id)


def test_deadlines_hold_across_hops(shared_cluster: LocalCluster) -> None:
    with tc.connect(shared_cluster.address) as c:
        plan = c.plan(ctx=tc.context(timeout=1.0))
        plan.wait(5.0)
        t0 = time.time()
        with pytest.raises(DeadlineExceeded):
            plan.run().result(timeout=30)
        assert time.time() - t0 < 3.0
        art = c.put(np.arange(10), on="w0")
        shared_cluster.pause_worker("w1")  # the gateway (w0) forwards to a worker that cannot answer
        try:
            t0 = time.time()
            with pytest.raises(DeadlineExceeded):
                art.prefetch(to="w1", timeout=1.0).result(timeout=30)
            assert time.time() - t0 < 3.0
        finally:
            shared_cluster.resume_worker("w1")
        c.delete(art.id)


def test_rerun_with_the_same_key_reuses_finished_steps(shared_cluster: LocalCluster) -> None:
    with tc.connect(shared_cluster.address) as c:
        art = c.put(np.arange(5000), on="w0")
        ctx = tc.context(timeout=30, idempotency_key="rerun-test")
        p1 = c.plan(ctx=ctx)
        pre = p1.prefetch(art, to="w1")
        p1.wait(0.1, pre.output)
        first = p1.run().result(timeout=30)
        assert first.ok and first.reused == ()
        p2 = c.plan(ctx=tc.context(timeout=30, idempotency_key="rerun-test"))
        pre2 = p2.prefetch(art, to="w1")
        p2.wait(0.1, pre2.output)
        second = p2.run().result(timeout=30)
        assert second.ok and set(second.reused) == {pre2.id, "wait-2"}
        assert second[pre2].started == first[pre].started  # the recorded run, not a new one
        c.delete(art.id)


def test_killed_gateway_then_rerun_on_another_gateway_finishes_without_duplicates() -> None:
    with running_cluster(workers=3) as cluster:
        g0 = tc.connect(cluster.workers["w0"].address)
        g1 = tc.connect(cluster.workers["w1"].address)
        try:
            art = g1.put(np.random.default_rng(5).integers(0, 255, MiB, dtype=np.uint8), on="w1")
            before = {a.id for a in g1.ls()}

            def build(client: tc.Client) -> tc.Plan:
                plan = client.plan(ctx=tc.context(timeout=60, idempotency_key="survive-gateway"))
                pre = plan.prefetch(art.id, to="w2")
                slow = plan.wait(2.0, pre.output)
                plan.prefetch(slow.output, to="w1")
                return plan

            op = build(g0).run()
            threading.Timer(0.8, cluster.kill_worker, args=("w0",)).start()
            # The gateway dies mid-plan: the client sends the plan (it has an idempotency key) to another
            # gateway, which finishes it; steps are idempotent, so whatever w0 had started is not repeated.
            assert op.result(timeout=30).ok
            assert g0.aio.caller.address != cluster.workers["w0"].address
            outcome = build(g1).run().result(timeout=60)
            assert outcome.ok
            assert {a.id for a in g1.ls()} == before, "re-running the plan created artifacts"
            holders = [r.worker_id for r in g1.artifact(art.id).replicas if r.tier == "memory"]
            assert sorted(holders) == ["w1", "w2"] and len(holders) == len(set(holders))
        finally:
            g0.close()
            g1.close()


def test_operations_are_lazy_handles(shared_cluster: LocalCluster) -> None:
    with tc.connect(shared_cluster.address) as c:
        op = c.ops.put({"x": np.arange(7)}, key="ops/x")
        art = op.result(timeout=30)
        assert op.done() and op.status() == "succeeded" and op.exception() is None
        got = c.ops.get("ops/x", like="numpy").result(timeout=30)
        assert np.array_equal(got["x"], np.arange(7))
        view = c.ops.view("ops/x", like="numpy", slices={"x": [(0, slice(2, 4))]}).result(timeout=30)
        assert np.array_equal(view["x"], np.arange(2, 4))
        bad = c.ops.get("ops/missing")
        assert isinstance(bad.exception(timeout=30), tc.errors.NotFound) and bad.status() == "failed"
        assert not bad.retryable
        pre = c.ops.prefetch("ops/x", "w1")
        assert pre.result(timeout=30).bytes_moved >= 0
        c.ops.unpin("ops/x", "w1").result(timeout=30)
        c.ops.delete(art.id).result(timeout=30)


def test_trace_id_reaches_the_logs_of_every_process_touched(shared_cluster: LocalCluster) -> None:
    with tc.connect(shared_cluster.address) as c:
        art = c.put(np.arange(4096), on="w0")
        trace = "trace-" + "5e7" * 4
        plan = c.plan(ctx=tc.context(timeout=30, trace_id=trace))
        plan.prefetch(art, to="w1")  # gateway w0 runs the plan; w1 pulls from w0
        assert plan.run().result(timeout=30).ok
        time.sleep(0.2)
        logs = shared_cluster.data_dir / "logs"
        for proc in ("w0", "w1"):
            lines = [json.loads(x) for x in (logs / f"{proc}.log").read_text().splitlines() if trace in x]
            assert lines and all(doc.get("trace_id") == trace for doc in lines), proc
        c.delete(art.id)
