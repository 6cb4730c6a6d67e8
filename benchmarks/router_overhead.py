"""What a router adds to a request: ``tensorcast router`` against the routers users pick instead, in one run.

Two stub engines (``openai_stub.py``: they answer at once, so the router is what is measured) behind each
router, round-robin: ``tensorcast router``, vLLM's router (PyPI ``vllm-router``) and the SGLang/Shepherd model
gateway (PyPI ``smg``, ``smg launch``), each where its binary is found (on PATH or beside this Python; else its
row says why). For each, and for a stub called directly (the floor):
- sequential completions: median and p99 latency, and the median added over calling the stub directly;
- streamed completions (16 chunks): median time to the first chunk and to the last;
- 32 completions in flight: requests per second, as a ratio to the stub called directly.
Client, routers and stubs share this host's cores: the figures are for comparing routers with each other.

Usage: python benchmarks/router_overhead.py [--quick | --smoke] [--json PATH]
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

from benchlib import Table, free_port, parse_args, parser, pick, write_json

HERE = Path(__file__).parent
BODY = {"model": "stub", "prompt": "hello " * 64, "max_tokens": 16}


def binary(name: str) -> str | None:
    return shutil.which(name) or next((str(p) for p in [Path(sys.executable).parent / name] if p.exists()), None)


@contextlib.contextmanager
def process(args: list[str], url: str, ready_path: str = "/health", timeout: float = 60.0) -> Iterator[str]:
    """``args`` running until the block ends; yields ``url`` once ``ready_path`` answers 200."""
    import urllib.request

    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError), urllib.request.urlopen(url + ready_path, timeout=2) as r:
                if r.status == 200:
                    break
            if proc.poll() is not None:
                raise RuntimeError(f"exited {proc.returncode}: {(proc.stderr.read() if proc.stderr else '')[-300:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready in {timeout:g} s")
            time.sleep(0.2)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()


def router_args(name: str, backends: list[str], port: int, policy: str = "round_robin") -> list[str] | str:
    """The command line of router ``name`` on ``port`` (a baseline with its ``policy``), or why it cannot run
    here."""
    if name == "tensorcast":
        return [sys.executable, "-m", "tensorcast", "router", "--policy", "round-robin", "--sessions", "off",
                "--port", str(port), *(x for b in backends for x in ("--backend", b))]
    exe = binary(name)
    if exe is None:
        return f"not installed (pip install {name})"
    launch = [exe] if name == "vllm-router" else [exe, "launch"]
    return [*launch, "--worker-urls", *backends, "--policy", policy, "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]  # not the shared default, 29000


async def measure(url: str, sequential: int, concurrent: int) -> dict[str, float]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(stream: bool = False) -> tuple[float, float]:
            t0 = time.perf_counter()
            first = 0.0
            async with session.post(url + "/v1/completions", json={**BODY, "stream": stream}) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
                async for _ in r.content.iter_any():
                    first = first or time.perf_counter() - t0
            return first, time.perf_counter() - t0

        for _ in range(20):  # connections and caches warm
            await one()
        lat = [(await one())[1] for _ in range(sequential)]
        streamed = [await one(stream=True) for _ in range(max(20, sequential // 4))]
        t0 = time.perf_counter()
        total = concurrent * 20
        sem = asyncio.Semaphore(concurrent)

        async def bounded() -> None:
            async with sem:
                await one()

        await asyncio.gather(*(bounded() for _ in range(total)))
        rate = total / (time.perf_counter() - t0)
    lat.sort()
    return {"p50_ms": statistics.median(lat) * 1e3, "p99_ms": lat[int(0.99 * (len(lat) - 1))] * 1e3,
            "first_chunk_ms": statistics.median(f for f, _ in streamed) * 1e3,
            "last_chunk_ms": statistics.median(t for _, t in streamed) * 1e3, "req_per_s": rate}


def main() -> None:
    args = parse_args(parser(__doc__, "500 sequential completions per router"))
    sequential = pick(args, 3000, 500, 50)
    concurrent = 32
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        ports = [free_port() for _ in range(2)]
        backends = [stack.enter_context(process([sys.executable, str(HERE / "openai_stub.py"), "--port", str(p)],
                                                f"http://127.0.0.1:{p}")) for p in ports]
        direct = asyncio.run(measure(backends[0], sequential, concurrent))
        rows.append({"target": "stub, direct", **direct})
        for name in ("tensorcast", "vllm-router", "smg"):
            port = free_port()
            cmd = router_args(name, backends, port)
            if isinstance(cmd, str):
                rows.append({"target": name, "error": cmd})
                continue
            try:
                with process(cmd, f"http://127.0.0.1:{port}", ready_path="/v1/models") as url:
                    rows.append({"target": name, **asyncio.run(measure(url, sequential, concurrent))})
            except RuntimeError as exc:
                rows.append({"target": name, "error": str(exc)})
    table = Table(("target", "<14"), ("p50 ms", ">8.3f"), ("added p50 ms", ">13.3f"), ("p99 ms", ">8.3f"),
                  ("1st chunk ms", ">13.3f"), ("last chunk ms", ">14.3f"), ("req/s @32", ">10.0f"),
                  ("x direct", ">9.2f"))
    for row in rows:
        if "error" in row:
            print(f"{row['target']}: {row['error']}")
            continue
        row["added_p50_ms"] = row["p50_ms"] - direct["p50_ms"]
        row["throughput_vs_direct"] = row["req_per_s"] / direct["req_per_s"]
        table.row(row["target"], row["p50_ms"], row["added_p50_ms"], row["p99_ms"], row["first_chunk_ms"],
                  row["last_chunk_ms"], row["req_per_s"], row["throughput_vs_direct"])
    write_json(args.json, "router_overhead", args.quick, sequential=sequential, concurrent=concurrent, rows=rows)


if __name__ == "__main__":
    main()
