"""Run by test_vllm_transfer.py as a trainer process: publishes a checkpoint's tensors through vLLM's
``WeightTransferTrainerFactory`` with the ``tensorcast`` backend, driving a ``vllm serve`` over its RL routes.

``python vllm_trainer.py SERVER_URL GATEWAY MODEL CHECKPOINT [--stall-after N | --then-delta OUT]`` prints
``RESULT {json}`` (the engine's ``last``). ``--stall-after N``: the source stops after N tensors (the test kills
the process there: a trainer dying mid-publish). ``--then-delta OUT``: after the first update, rows 40 to 240
of layer 0's MLP projections change and a second update follows (a sparse delta, the trainer naming the
changed tensors); the state it sent is saved
to OUT, and ``RESULT`` is the second update's, with ``first`` and the ``true_changed_bytes``."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from typing import Any


def main() -> None:
    url, gateway, model, checkpoint = sys.argv[1:5]
    option, value = (sys.argv[5], sys.argv[6]) if len(sys.argv) > 6 else (None, None)
    stall = int(value) if option == "--stall-after" and value else None
    from safetensors.torch import load_file, save_file
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from tensorcast.integrations.vllm import register
    from tensorcast.integrations.vllm_transfer_trainer import (
        StateDictSource,
        TensorCastHTTPClient,
        TensorCastTrainerInitInfo,
    )

    register()

    class Stalling(StateDictSource):  # type: ignore[misc]
        def __iter__(self) -> Iterator[tuple[str, Any]]:
            for i, item in enumerate(self.state.items()):
                if stall is not None and i == stall:
                    print("STALLED", flush=True)
                    time.sleep(3600)
                yield item

    state = load_file(checkpoint)
    engine = WeightTransferTrainerFactory.trainer_init(
        TensorCastTrainerInitInfo(rank=0, address=gateway, model=model, timeout=120.0),
        client=TensorCastHTTPClient(url, timeout=300), source=Stalling(state))
    engine.send_weights()
    last = engine.last
    if option == "--then-delta" and value:
        changed, names = 0, [n for n in state if ".0.mlp." in n and n.endswith(("gate_proj.weight", "up_proj.weight"))]
        for name in names:
            state[name] = state[name].clone()
            state[name][40:240] += 0.25
            changed += state[name][40:240].nbytes
        engine.source.changed = names  # the trainer knows: the other tensors are not read
        engine.send_weights()
        save_file(state, value)
        last = {**engine.last, "first": last, "true_changed_bytes": changed}
    print("RESULT " + json.dumps(last), flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
