"""Run by test_vllm_transfer.py as a trainer process: publishes a checkpoint's tensors through vLLM's
``WeightTransferTrainerFactory`` with the ``tensorcast`` backend, driving a ``vllm serve`` over its RL routes.

``python vllm_trainer.py SERVER_URL GATEWAY MODEL CHECKPOINT [--stall-after N]`` prints ``RESULT {json}``
(the engine's ``last``). ``--stall-after N``: the source stops after N tensors (the test kills the process
there: a trainer dying mid-publish)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from typing import Any


def main() -> None:
    url, gateway, model, checkpoint = sys.argv[1:5]
    stall = int(sys.argv[6]) if len(sys.argv) > 6 and sys.argv[5] == "--stall-after" else None
    from safetensors.torch import load_file
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

    engine = WeightTransferTrainerFactory.trainer_init(
        TensorCastTrainerInitInfo(rank=0, address=gateway, model=model, timeout=120.0),
        client=TensorCastHTTPClient(url, timeout=300), source=Stalling(load_file(checkpoint)))
    engine.send_weights()
    print("RESULT " + json.dumps(engine.last), flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
