"""One vLLM engine in its own process, driven by JSON lines: for tests and benchmarks of KV connectors.

``python -m tensorcast.testing.vllm_engine MODEL_DIR '{"kv_role": "kv_both", ...}'`` starts ``vllm.LLM``
(CPU build: float32 unless told, eager) with ``TensorCastConnector`` unless ``kv_role`` is null, prints
``READY``, then answers each request line ``{"prompt": [ids], "max_tokens": N, "kv_transfer_params": {...}}``
with one line ``{"tokens": [...], "num_cached_tokens": N, "kv_transfer_params": ..., "ttft": s, "seconds": s}``;
``{"reset_prefix_cache": true}`` empties vLLM's own prefix cache (answer ``{"reset": bool}``).
``EngineProcess`` is the parent's handle; its options choose another connector (``connector`` with its
``extra`` config, e.g. vLLM's bundled ``MooncakeStoreConnector``), vLLM's own prefix cache, the model length,
the dtype, and ``log_stats`` (vLLM then measures ``ttft`` itself: from the request's arrival to its first
token; otherwise ``ttft`` is null and ``seconds``, the whole ``generate`` call, is the closest measure).
``submit`` and ``result`` let a parent keep several engines busy at the same time.
The cluster address comes from ``TENSORCAST_ADDRESS`` and the host id from ``TENSORCAST_CLIENT_HOST_ID``, as
for any engine process. Does not own: the connectors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tensorcast.errors import Unavailable

__all__ = ["EngineProcess", "llama_dir", "tiny_llama_dir"]

# A real small model's shape (SmolLM2-135M: Llama, tied embeddings), for benchmarks with random weights.
SMOLLM2_135M: dict[str, Any] = {"layers": 30, "hidden": 576, "heads": 9, "kv_heads": 3, "intermediate": 1536,
                                "vocab": 49152, "tie_embeddings": True}


def llama_dir(path: Path, *, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
              max_positions: int = 4096, tie_embeddings: bool = False, seed: int = 3,
              dtype: str = "float32") -> Path:
    """A Llama checkpoint with random weights of the given shape, written to ``path`` (``dtype`` on disk)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=hidden // heads, max_position_embeddings=max_positions,
                      tie_word_embeddings=tie_embeddings)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)  # type: ignore[no-untyped-call]
    model.to(getattr(torch, dtype)).save_pretrained(path)
    return path


def tiny_llama_dir(path: Path, *, layers: int = 2, hidden: int = 256, vocab: int = 512, seed: int = 3) -> Path:
    """A random Llama checkpoint vLLM's CPU backend accepts (head_dim 64), float32, written to ``path``."""
    return llama_dir(path, layers=layers, hidden=hidden, heads=hidden // 64, kv_heads=max(1, hidden // 128),
                     intermediate=2 * hidden, vocab=vocab, seed=seed)


def tiny_mla_dir(path: Path, *, layers: int = 2, seed: int = 3) -> Path:
    """A random DeepSeek-V3 checkpoint (multi-head latent attention, dense layers), float32, written to ``path``.
    vLLM's CPU MLA backend takes one shape only: a 512-wide latent with 64 rotary dims (head size 576), blocks
    of 16 tokens (it overrides the block size), and no prefix cache on a CPU."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    # topk_method and scoring_func are what vLLM's DeepSeek code reads to build its router.
    fields: dict[str, Any] = dict(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None,
        qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=layers, max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, n_group=1, topk_group=1,
        topk_method="noaux_tc", scoring_func="sigmoid")
    cfg = DeepseekV3Config(**fields)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg)
    model.save_pretrained(path)  # float32: torch's default dtype
    return path


def _log_tail(path: Path | None, lines: int = 6) -> str:
    """The last error-looking lines of an engine's log: what a caller reports when the engine did not start."""
    if path is None or not path.exists():
        return ""
    text = path.read_text(errors="replace").splitlines()
    errors = [ln for ln in text if "Error" in ln or "error" in ln or "Exception" in ln]
    return " | ".join((errors or text)[-lines:])


class EngineProcess:
    """A vLLM engine process. ``connector``: the KV connector's registered name (``kv_role`` None: none);
    ``extra``: its ``kv_connector_extra_config``; ``wait=False`` returns at once (call ``wait_ready``), so
    that several engines start at the same time. ``single_process``: vLLM's engine core and its worker run
    in this one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor), ~1 GiB less memory
    per engine than vLLM's default three processes. ``kv_events``: a ZeroMQ endpoint vLLM publishes its KV
    events on (``kv_events_config``). ``attention_backend``: vLLM's attention backend by name (vLLM's choice
    when None)."""

    def __init__(self, model_dir: Path, *, address: str, host_id: str, kv_role: str | None = "kv_both",
                 extra: dict[str, Any] | None = None, startup_timeout: float = 600.0,
                 env: dict[str, str] | None = None, log_path: Path | None = None,
                 connector: str = "TensorCastConnector", enable_prefix_caching: bool = False,
                 max_model_len: int = 4096, dtype: str = "float32", log_stats: bool = False,
                 single_process: bool = False, kv_events: str | None = None, wait: bool = True,
                 attention_backend: str | None = None) -> None:
        options = {"kv_role": kv_role, "extra": extra or {}, "connector": connector,
                   "enable_prefix_caching": enable_prefix_caching, "max_model_len": max_model_len,
                   "dtype": dtype, "log_stats": log_stats, "single_process": single_process,
                   "kv_events": kv_events, "attention_backend": attention_backend}
        child_env = {**os.environ, "TENSORCAST_ADDRESS": address, "TENSORCAST_CLIENT_HOST_ID": host_id,
                     "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), **(env or {})}
        self.log_path = log_path
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115
        self._startup_timeout = startup_timeout
        self._started = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "tensorcast.testing.vllm_engine", str(model_dir),
                                      json.dumps(options)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, env=child_env, text=True)
        self.ready = False
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        deadline = self._started + self._startup_timeout
        assert self.proc.stdout is not None
        while not self.ready:
            line = self.proc.stdout.readline()
            if line.startswith("READY"):
                self.ready = True
                break
            if not line or time.monotonic() > deadline:
                self.close()
                raise Unavailable(f"vLLM engine did not start (exit {self.proc.poll()}); log {self.log_path}: "
                                  f"{_log_tail(self.log_path)}")

    def submit(self, prompt: list[int], max_tokens: int = 8, kv_transfer_params: dict[str, Any] | None = None
               ) -> None:
        """Send one request; ``result`` reads its answer (one request in flight per engine)."""
        assert self.proc.stdin is not None
        req = {"prompt": prompt, "max_tokens": max_tokens, "kv_transfer_params": kv_transfer_params}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()

    def result(self, timeout: float = 600.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise Unavailable(f"vLLM engine exited ({self.proc.poll()}): {_log_tail(self.log_path)}")
            if line.startswith("RESULT "):
                out: dict[str, Any] = json.loads(line[len("RESULT "):])
                if "error" in out:
                    raise RuntimeError(out["error"])
                return out
        raise Unavailable("vLLM engine did not answer in time")

    def generate(self, prompt: list[int], max_tokens: int = 8, kv_transfer_params: dict[str, Any] | None = None,
                 timeout: float = 600.0) -> dict[str, Any]:
        self.submit(prompt, max_tokens, kv_transfer_params)
        return self.result(timeout)

    def reset_prefix_cache(self, attempts: int = 20, timeout: float = 60.0) -> None:
        """Empty vLLM's own prefix cache (not the connector's store): the next request with a known prefix
        asks the connector again. vLLM refuses while blocks are held, e.g. by a connector still saving them
        (it frees them when a later step reports the save done; an idle engine takes no step): so each refusal
        is followed by a 2-token request (no full block: nothing to save or load), and the reset retried."""
        assert self.proc.stdin is not None
        for _ in range(attempts):
            self.proc.stdin.write(json.dumps({"reset_prefix_cache": True}) + "\n")
            self.proc.stdin.flush()
            if self.result(timeout)["reset"]:
                return
            self.generate([1, 2], 1, timeout=timeout)
            time.sleep(0.05)
        raise RuntimeError(f"vLLM kept refusing to reset its prefix cache ({attempts} attempts)")

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                # A serving engine exits at the end of its input; one still starting reads none before it is
                # ready: nothing of it is worth waiting for.
                self.proc.wait(timeout=60 if self.ready else 0.1)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not isinstance(self._log, int):  # a file we opened (not DEVNULL)
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

    single = bool(options.get("single_process", False))
    if single:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read when vLLM's engine starts
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    executor: dict[str, Any] = {"distributed_executor_backend": "uni"} if single else {}
    kv = None
    if options.get("kv_role"):
        kv = {"kv_connector": options.get("connector") or "TensorCastConnector", "kv_role": options["kv_role"],
              "kv_connector_extra_config": options.get("extra", {}), "kv_load_failure_policy": "recompute"}
    if options.get("kv_events"):  # vLLM's own KV events, published on this ZeroMQ endpoint
        from vllm.config import KVEventsConfig

        executor["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                      endpoint=options["kv_events"])
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype=options.get("dtype", "float32"),
              max_model_len=int(options.get("max_model_len", 4096)), enforce_eager=True,
              enable_prefix_caching=bool(options.get("enable_prefix_caching", False)), kv_transfer_config=kv,
              block_size=32, disable_log_stats=not options.get("log_stats", False),
              **executor, **({"attention_backend": options["attention_backend"]}
                             if options.get("attention_backend") else {}))
    answer("READY")
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req.get("reset_prefix_cache"):
                answer("RESULT " + json.dumps({"reset": llm.reset_prefix_cache()}))
                continue
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
                "kv_transfer_params": out.kv_transfer_params, "ttft": ttft or None, "seconds": seconds}))
        except Exception as exc:  # the parent sees the error; the engine keeps serving
            answer("RESULT " + json.dumps({"error": f"{type(exc).__name__}: {exc}"}))


if __name__ == "__main__":
    _serve(sys.argv[1], json.loads(sys.argv[2]))
