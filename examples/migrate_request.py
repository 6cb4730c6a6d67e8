"""Migrate a running request's KV cache from one instance to another with one plan.

The caller observes load (``list_instances``), then one plan does the move:
``publish`` the request's KV on the busy instance -> ``prefetch`` it to the idle instance's home worker
-> ``hydrate`` it there. The request then continues on the idle instance exactly as if it had prefilled
the prompt itself — no recompute.

Run: python examples/migrate_request.py   (starts a local cluster and two tiny Llama instances on CPU)
"""

from __future__ import annotations

import time

import numpy as np

import tensorcast as tc


def migrate(client: tc.Client, request_id: str, source: str, target: str) -> tc.PlanOutcome:
    """Move ``request_id``'s KV cache from instance ``source`` to instance ``target`` with one plan."""
    homes = {i.instance_id: i.home_worker for i in client.list_instances()}
    ctx = tc.context(timeout=60, idempotency_key=f"migrate-{request_id}-{source}-{target}")
    plan = client.plan(ctx=ctx)
    pub = plan.publish(instance=source, request_id=request_id)
    pre = plan.prefetch(pub.output, to=homes[target])
    plan.hydrate(instance=target, request_id=request_id, artifacts=pub.output, after=[pre])
    return plan.run(concurrency=4).result()


def main() -> None:
    with tc.LocalCluster(workers=2) as cluster, tc.connect(cluster.address) as client:
        cluster.start_instance("inst-a", "w0", ["--seed", "0"])
        cluster.start_instance("inst-b", "w1", ["--seed", "0"])  # same weights: a second replica of the model

        prompt = [int(t) for t in np.random.default_rng(42).integers(0, 256, 48)]
        client.call_instance("inst-a", "engine", args={"command": "prefill", "request_id": "req-42",
                                                         "input_ids": prompt})
        # A router's view: inst-a is busy, inst-b idle (load arrives with the next instance heartbeat).
        deadline = time.time() + 5
        while time.time() < deadline and not any(i.running for i in client.list_instances()):
            time.sleep(0.1)
        for inst in client.list_instances():
            print(f"{inst.instance_id}: home {inst.home_worker}, running {inst.running}, "
                  f"KV tokens {inst.kv_tokens_used}")

        outcome = migrate(client, "req-42", source="inst-a", target="inst-b")
        for step in outcome.steps:
            print(f"  {step.id:<12} {step.status:<10} attempts={step.attempts} output={list(step.output)}")
        assert outcome.ok

        moved = client.call_instance("inst-b", "engine", args={"command": "generate", "request_id": "req-42",
                                                                 "max_new_tokens": 8}).result["tokens"]
        # Reference: inst-b recomputes the prompt from scratch.
        client.call_instance("inst-b", "engine", args={"command": "prefill", "request_id": "ref",
                                                         "input_ids": prompt})
        ref = client.call_instance("inst-b", "engine", args={"command": "generate", "request_id": "ref",
                                                               "max_new_tokens": 8}).result["tokens"]
        print(f"continued after migration: {moved}\nrecomputed from scratch:   {ref}")
        assert moved == ref, "migration changed the continuation"
        print("same continuation: the migrated request resumed without recompute")


if __name__ == "__main__":
    main()
