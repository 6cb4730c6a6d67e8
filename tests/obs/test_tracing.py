"""A put and a plan under one context are one trace: the caller's spans, the gateway's plan and steps, and
the calls they make to other workers and the global store, across processes, linked parent to child by the
ids in the envelopes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import tensorcast as tc
from tensorcast.obs import tracing
from tensorcast.testing import running_cluster


def _file_spans(path: Path, trace: str, want: set[str], timeout: float = 20.0) -> list[dict[str, object]]:
    """The trace's spans the cluster's processes wrote, once every name in ``want`` is there (spans are
    exported when they end; the last ones end just after the caller has its reply)."""
    deadline = time.monotonic() + timeout
    while True:
        spans = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        mine = [s for s in spans if s["trace_id"] == trace]
        if want <= {str(s["name"]) for s in mine} or time.monotonic() > deadline:
            return mine
        time.sleep(0.1)


def test_one_plan_is_one_trace_across_processes(tmp_path: Path) -> None:
    spans_file = tmp_path / "spans.jsonl"
    exporter = InMemorySpanExporter()
    tracing.use_provider(tracing.provider(exporter, "test-caller"))
    try:
        config = {"tracing.exporter": "file", "tracing.file": str(spans_file)}
        with running_cluster(workers=2, config=config) as cluster, tc.connect(cluster.address) as client:
            ctx = tc.context(timeout=60)  # the put and the plan after it: one trace
            art = client.put({"w": np.arange(4096, dtype=np.float32)}, key="traced@v1", ctx=ctx)
            plan = client.plan(ctx=ctx)
            pre = plan.prefetch(art, to="w1")
            plan.pin(art, on="w1", after=[pre])
            assert plan.run().result().ok
            trace = f"{tracing.otel_trace_id(ctx.trace_id):032x}"
            want = {"serve RunPlan", "plan", "step prefetch", "step pin", "serve Prefetch", "serve GetArtifact",
                    "serve PutBegin", "serve CommitArtifact"}
            remote = _file_spans(spans_file, trace, want)
            time.sleep(2.0)  # heartbeats and lease renewals ran meanwhile: they start no traces of their own
            background = [json.loads(line)["name"] for line in spans_file.read_text().splitlines()
                          if json.loads(line)["trace_id"] != trace]
            assert not any("Heartbeat" in n or "Shards" in n for n in background), background[:5]
    finally:
        tracing.use_provider(None)

    local = [s for s in exporter.get_finished_spans() if f"{s.context.trace_id:032x}" == trace]
    # The caller's two roots: the put (its calls under it) and the plan.
    assert sorted(s.name for s in local if s.parent is None) == ["RunPlan", "put"]
    (run_plan,) = [s for s in local if s.name == "RunPlan"]
    (put,) = [s for s in local if s.name == "put"]
    root = f"{run_plan.context.span_id:016x}"
    under_put = {f"{s.context.span_id:016x}" for s in local if s.parent is not None and s.parent.span_id
                 == put.context.span_id}
    assert under_put and all(s.parent is None or s.parent.span_id in (put.context.span_id, run_plan.context.span_id)
                             for s in local)
    assert want <= {str(s["name"]) for s in remote}
    services = {str(s["service"]) for s in remote}
    assert {"tensorcast-worker-w0", "tensorcast-worker-w1", "tensorcast-gs"} <= services
    assert len({s["pid"] for s in remote}) >= 3

    by_id = {str(s["span_id"]): s for s in remote}
    assert len(by_id) == len(remote)

    def chain_end(span: dict[str, object]) -> tuple[str, list[str]]:
        """The caller's span a remote span's chain of parents ends at, and the names along the way."""
        names, node = [], span
        while node["parent_span_id"] not in under_put | {root}:
            node = by_id[str(node["parent_span_id"])]  # every parent is a span of this trace
            names.append(str(node["name"]))
            assert len(names) < 20
        return str(node["parent_span_id"]), names

    # One tree per root: the put's work (on the worker, then the global store) under the put's call, and
    # everything else under the plan.
    put_work = {"serve PutBegin", "CommitArtifact", "serve CommitArtifact"}
    ends = [(str(s["name"]), chain_end(s)[0]) for s in remote]
    assert put_work <= {name for name, _ in ends}
    assert all((end in under_put) == (name in put_work) for name, end in ends), ends
    assert all(end == root for name, end in ends if name not in put_work)

    def ancestors(span: dict[str, object]) -> list[str]:
        return chain_end(span)[1]

    (serve_plan,) = [s for s in remote if s["name"] == "serve RunPlan"]
    assert serve_plan["parent_span_id"] == root and serve_plan["service"] == "tensorcast-worker-w0"
    (step,) = [s for s in remote if s["name"] == "step prefetch"]
    assert step["attributes"] == {"step": "prefetch-1", "op": "prefetch"}

    # The prefetch and the pin both reach w1 as Prefetch requests, each under its own step.
    served = [ancestors(s) for s in remote if s["name"] == "serve Prefetch" and s["service"] == "tensorcast-worker-w1"]
    assert sorted(next(n for n in chain if n.startswith("step ")) for chain in served) == ["step pin", "step prefetch"]
    assert all(chain[-2:] == ["plan", "serve RunPlan"] for chain in served), served


def test_a_caller_provider_starts_traces_after_a_worker_configured_this_process(tmp_path: Path) -> None:
    """A process that hosted a worker (``configure(..., roots=False)``: its background work emits nothing)
    and then runs a caller with its own provider starts the caller's traces: the flag goes with the provider,
    so a test (or a service embedding a worker) does not silently lose its root spans."""
    from tensorcast.config import TracingConfig

    exporter = InMemorySpanExporter()
    try:
        tracing.configure(TracingConfig(exporter="file", file=str(tmp_path / "w.jsonl")), "worker", roots=False)
        with tracing.span("heartbeat", "ab12"):
            pass  # a cluster process's own work: no trace
        assert not (tmp_path / "w.jsonl").read_text()
        tracing.configure(TracingConfig(), "another worker", roots=False)  # no exporter: changes nothing
        tracing.use_provider(tracing.provider(exporter, "caller"))
        with tracing.span("put", "ab12"):
            pass
    finally:
        tracing.use_provider(None)
    assert [s.name for s in exporter.get_finished_spans()] == ["put"]
    assert exporter.get_finished_spans()[0].context.trace_id == tracing.otel_trace_id("ab12")
