"""One vLLM engine in its own process, driven by JSON lines: for tests and benchmarks of the KV connector.

``python -m tensorcast.testing.vllm_engine MODEL_DIR '{"kv_role": "kv_both", ...}'`` starts ``vllm.LLM``
(CPU build: float32, eager) with ``TensorCastConnector`` unless ``kv_role`` is null, prints ``READY``, then
answers each request line ``{"prompt": [ids], "max_tokens": N, "kv_transfer_params": {...}}`` with one
line ``{"tokens": [...], "num_cached_tokens": N, "kv_transfer_params": ..., "ttft": s, "seconds": s}``.
``EngineProcess`` is the parent's handle. The cluster address comes from ``TENSORCAST_ADDRESS`` and the
host id from ``TENSORCAST_CLIENT_HOST_ID``, as for any engine process. Does not own: the connector.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from tensorcast.errors import Unavailable

__all__ = ["EngineProcess", "tiny_llama_dir"]


def tiny_llama_dir(path: Path, *, layers: int = 2, hidden: int = 256, vocab: int = 512, seed: int = 3) -> Path:
    """A random Llama checkpoint vLLM's CPU backend accepts (head_dim 64), float32, written to ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128),
                      max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)  # type: ignore[no-untyped-call]
    model.float().save_pretrained(path)  # type: ignore[no-untyped-call]
    return path


class EngineProcess:
    def __init__(self, model_dir: Path, *, address: str, host_id: str, kv_role: str | None = "kv_both",
                 extra: dict[str, Any] | None = None, startup_timeout: float = 600.0,
                 env: dict[str, str] | None = None, log_path: Path | None = None) -> None:
        options = {"kv_role": kv_role, "extra": extra or {}}
        child_env = {**os.environ, "TENSORCAST_ADDRESS": address, "TENSORCAST_CLIENT_HOST_ID": host_id,
                     "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), **(env or {})}
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, "-m", "tensorcast.testing.vllm_engine", str(model_dir),
                                      json.dumps(options)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, env=child_env, text=True)
        deadline = time.monotonic() + startup_timeout
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if line.startswith("READY"):
                break
            if not line or time.monotonic() > deadline:
                self.close()
                raise Unavailable(f"vLLM engine did not start (exit {self.proc.poll()}); see {log_path}")

    def generate(self, prompt: list[int], max_tokens: int = 8, kv_transfer_params: dict[str, Any] | None = None,
                 timeout: float = 600.0) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        req = {"prompt": prompt, "max_tokens": max_tokens, "kv_transfer_params": kv_transfer_params}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise Unavailable(f"vLLM engine exited ({self.proc.poll()})")
            if line.startswith("RESULT "):
                out: dict[str, Any] = json.loads(line[len("RESULT "):])
                if "error" in out:
                    raise RuntimeError(out["error"])
                return out
        raise Unavailable("vLLM engine did not answer in time")

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if isinstance(self._log, IO):
            self._log.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve(model_dir: str, options: dict[str, Any]) -> None:
    # Answers go to the parent on the real stdout; everything else printed here (vLLM logs to stdout) to stderr.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def answer(line: str) -> None:
        answers.write(line + "\n")
        answers.flush()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kv = None
    if options.get("kv_role"):
        kv = {"kv_connector": "TensorCastConnector", "kv_role": options["kv_role"],
              "kv_connector_extra_config": options.get("extra", {}), "kv_load_failure_policy": "recompute"}
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=4096, enforce_eager=True,
              enable_prefix_caching=False, kv_transfer_config=kv, block_size=32)
    answer("READY")
    for line in sys.stdin:
        req = json.loads(line)
        try:
            params = SamplingParams(temperature=0, max_tokens=req["max_tokens"],
                                    extra_args={"kv_transfer_params": req["kv_transfer_params"]}
                                    if req.get("kv_transfer_params") else None)
            t0 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=req["prompt"])], params, use_tqdm=False)[0]
            seconds = time.perf_counter() - t0
            metrics = getattr(out, "metrics", None)
            ttft = getattr(metrics, "first_token_latency", None) if metrics is not None else None
            answer("RESULT " + json.dumps({
                "tokens": list(out.outputs[0].token_ids), "num_cached_tokens": out.num_cached_tokens,
                "kv_transfer_params": out.kv_transfer_params, "ttft": ttft, "seconds": seconds}))
        except Exception as exc:  # the parent sees the error; the engine keeps serving
            answer("RESULT " + json.dumps({"error": f"{type(exc).__name__}: {exc}"}))


if __name__ == "__main__":
    _serve(sys.argv[1], json.loads(sys.argv[2]))
