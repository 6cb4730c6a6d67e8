"""One vLLM instance, started in a fresh process by ``weights_load.py``: build an ``LLM`` with the given
load format, produce one token, print ``READY <unix time>`` and exit. The parent measures instance-ready
time from before it spawned this process. The engine runs in this process (TP=1), so that the loader's
``load_weights`` can be timed here the same way for every load format: printed as ``WEIGHTS <seconds>``.

Usage: python benchmarks/vllm_instance.py MODEL_DIR LOAD_FORMAT [EXTRA_CONFIG_JSON [TP]]
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def main() -> None:
    model_dir, load_format = sys.argv[1], sys.argv[2]
    extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    tp = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if tp == 1:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    original = BaseModelLoader.load_model

    def timed_load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        load_weights = self.load_weights

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return load_weights(*a, **kw)
            finally:
                print(f"WEIGHTS {time.perf_counter() - t0}", flush=True)

        self.load_weights = timed
        return original(self, *args, **kwargs)

    BaseModelLoader.load_model = timed_load_model  # type: ignore[method-assign]
    llm = LLM(model=model_dir, skip_tokenizer_init=True, load_format=load_format, dtype="bfloat16",
              max_model_len=256, enforce_eager=True, tensor_parallel_size=tp, model_loader_extra_config=extra,
              distributed_executor_backend="uni" if tp == 1 else "mp")
    out = llm.generate([TokensPrompt(prompt_token_ids=[1, 5, 9, 33])], SamplingParams(temperature=0, max_tokens=1),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 1
    print(f"READY {time.time()}", flush=True)
    os._exit(0)  # skip the engine's slow teardown: it is not part of instance-ready time


if __name__ == "__main__":
    main()
