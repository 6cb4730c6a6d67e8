"""The stores ``benchmarks/kv_reuse.py`` compares TensorCast with, set up as their users would: Mooncake Store's
master and the configuration vLLM's ``MooncakeStoreConnector`` reads, LMCache's ``lm://`` server, the environment
its connector reads and a one-instance probe of whether it starts (and starts with its engine, not degraded).

Owns: starting and stopping those processes (on loopback), finding LMCache (the venv's or a ``--target``
directory), and reading an engine's log for a connector's start-up error. Does not own: the engines, the
measurements or the report.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from benchlib import free_port
from tensorcast.testing.vllm_engine import EngineProcess

# Mooncake's TCP transport: listen on loopback only; and queue a whole prompt's pages per peer, as its users
# tune it (with the defaults, an 8k-token prompt's 255 pages were partly rejected, "TCP lane queue-full",
# and vLLM recomputed them: first-token times of 4-15 s instead of a fraction of one).
MOONCAKE_TCP = {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
                "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535", "MC_TCP_ADMISSION_TIMEOUT_MS": "120000"}


def log_error(path: Path | None, pattern: str) -> str | None:
    """The exception line after ``pattern`` in an engine's log (a connector that started degraded)."""
    if path is None or not path.exists():
        return None
    text = path.read_text(errors="replace")
    at = text.find(pattern)
    if at < 0:
        return None
    after = text[at:].splitlines()
    exc = next((ln.strip() for ln in after[1:40] if re.match(r"\s*\w+(Error|Exception): ", ln)), after[0])
    return f"{pattern}: {exc}"



@contextlib.contextmanager
def mooncake_master(work: Path) -> Iterator[Path]:
    """A ``mooncake_master`` on loopback with its HTTP metadata server, and the config file vLLM reads."""
    master = shutil.which("mooncake_master") or os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    if not os.path.exists(master):
        raise FileNotFoundError("mooncake_master not found: pip install mooncake-transfer-engine-non-cuda "
                                "(and Debian libibverbs1)")
    rpc, http = free_port(), free_port()
    with open(work / "mooncake_master.log", "wb") as log:
        proc = subprocess.Popen([master, f"--rpc_port={rpc}", "--enable_http_metadata_server=true",
                                 "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={http}",
                                 "--rpc_address=127.0.0.1", f"--metrics_port={free_port()}"],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        time.sleep(1.5)
        if proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited ({proc.returncode}); see {work / 'mooncake_master.log'}")
        config = work / f"mooncake-{rpc}.json"
        # Embedded mode: every instance lends a segment to the pool (enough for a run's pages); the local
        # buffer stages a request's pages (the CPU build registers no KV cache memory with the engine).
        config.write_text(json.dumps({
            "metadata_server": f"http://127.0.0.1:{http}/metadata", "master_server_address": f"127.0.0.1:{rpc}",
            "protocol": "tcp", "device_name": "", "global_segment_size": "1GB", "local_buffer_size": "512MB"}))
        yield config
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def lmcache_server(work: Path, pythonpath: str) -> Iterator[str]:
    """LMCache's own KV server (``lm://``), the remote store its instances share."""
    port = free_port()
    with open(work / "lmcache_server.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port)],
                                env={**os.environ, "PYTHONPATH": pythonpath}, stdout=log, stderr=subprocess.STDOUT)
    try:
        time.sleep(3)
        yield f"lm://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def lmcache_pythonpath(extra: str | None) -> str | None:
    """PYTHONPATH under which ``lmcache`` imports (the venv's, or ``extra`` in front), or None."""
    path = os.pathsep.join(p for p in [extra, os.environ.get("PYTHONPATH")] if p)
    probe = subprocess.run([sys.executable, "-c", "import lmcache.integration.vllm.vllm_v1_adapter"],
                           env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True)
    return path if probe.returncode == 0 else None


def lmcache_env(pythonpath: str, url: str) -> dict[str, str]:
    # Everything in LMCache's own CPU memory and its lm:// server (the store the instances share).
    return {"PYTHONPATH": pythonpath, "LMCACHE_CHUNK_SIZE": "256", "LMCACHE_LOCAL_CPU": "False",
            "LMCACHE_MAX_LOCAL_CPU_SIZE": "1", "LMCACHE_REMOTE_URL": url, "LMCACHE_REMOTE_SERDE": "naive"}


def probe_lmcache(model: Path, work: Path, pythonpath: str, max_len: int) -> str:
    """One LMCache instance: does it start, and start with its engine (not in its degraded, recompute-only
    mode)? Cheaper than starting N to find out."""
    with lmcache_server(work, pythonpath) as url:
        try:
            with EngineProcess(model, address="-", host_id="-", kv_role="kv_both", connector="LMCacheConnectorV1",
                               env=lmcache_env(pythonpath, url), max_model_len=max_len, dtype="bfloat16",
                               single_process=True, log_path=work / "lmcache-probe.log"):
                pass
        except Exception as exc:
            return f"did not start: {exc}"
    degraded = log_error(work / "lmcache-probe.log", "Failed to initialize LMCacheManager components")
    return f"starts degraded (recomputes everything): {degraded}" if degraded else "ran"
