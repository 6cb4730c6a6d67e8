"""Run by test_vllm_weights.py in a fresh process: a vLLM engine started on version 1 of a model is swapped
to version 2 through TensorCast (``TensorCastWeightSync`` via ``collective_rpc``), then a fresh engine is
started on version 2's checkpoint; prints the greedy generations as JSON."""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    v1_dir, v2_dir, address, model = sys.argv[1:5]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=[1, 5, 9, 33, 77, 100, 3, 250] * 4)]
    params = SamplingParams(temperature=0, max_tokens=12)
    common = {"skip_tokenizer_init": True, "dtype": "float32", "max_model_len": 256, "enforce_eager": True}
    out: dict[str, object] = {}
    llm = LLM(model=v1_dir, worker_extension_cls="tensorcast.integrations.vllm_weights.TensorCastWeightSync",
              **common)
    out["v1"] = list(llm.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids)
    out["prepared"] = llm.collective_rpc("tensorcast_prepare", args=(model, 2, address))
    out["v1 while prepared"] = list(llm.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids)
    out["activated"] = llm.collective_rpc("tensorcast_activate")
    llm.reset_prefix_cache()
    out["swapped to v2"] = list(llm.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids)
    del llm
    fresh = LLM(model=v2_dir, **common)
    out["fresh v2"] = list(fresh.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
