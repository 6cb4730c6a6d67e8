"""``tensorcast router`` as a service, in front of OpenAI-speaking backends (small aiohttp servers here; real
``vllm serve`` instances in ``tests/integrations/test_vllm_router.py``): policies by name, sticky sessions,
cache affinity that holds against load, streaming passed through unbuffered, a dead backend routed around,
and typed OpenAI-style errors."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp")

from tensorcast.errors import InvalidArgument  # noqa: E402
from tensorcast.policies import Request, Router  # noqa: E402
from tensorcast.router import RouterService, make_policy, register_policy  # noqa: E402
from tensorcast.router.choice import as_instances, route_view  # noqa: E402

from .conftest import Backend, complete, dead_url, run, running  # noqa: E402


def test_round_robin_models_health_and_metrics() -> None:
    async def scenario() -> None:
        async with running(make_policy("round-robin", sessions="off")) as (service, _backends, session):
            got = [(await complete(session, service, {"prompt": f"p{i}", "max_tokens": 1}))["backend"]
                   for i in range(4)]
            assert got == ["b0", "b1", "b0", "b1"]
            async with session.post(service.url + "/v1/chat/completions",
                                    json={"messages": [{"role": "user", "content": "hi"}]}) as r:
                doc = await r.json()
                assert doc["path"] == "/v1/chat/completions" and doc["echo"]["messages"][0]["content"] == "hi"
            async with session.get(service.url + "/v1/models") as r:
                assert (await r.json())["data"][0]["id"] == "tiny"
            async with session.get(service.url + "/health") as r:
                assert r.status == 200 and (await r.json())["alive"] == ["b0", "b1"]
            async with session.get(service.url + "/metrics") as r:
                text = await r.text()
                assert 'tensorcast_router_requests_total{backend="b0",outcome="200"} 3.0' in text  # 2 + 1 chat
                assert "tensorcast_router_decision_seconds_count" in text
                assert 'tensorcast_router_first_byte_seconds_count{backend="b0"} 3.0' in text

    run(scenario)


def test_a_session_sticks_by_header_or_user_field() -> None:
    async def scenario() -> None:
        async with running(make_policy("round-robin")) as (service, _backends, session):
            by_header = {(await complete(session, service, {"prompt": "x"}, **{"X-Session-Id": "s1"}))["backend"]
                         for _ in range(4)}
            by_user = {(await complete(session, service, {"prompt": "x", "user": "alice"}))["backend"]
                       for _ in range(4)}
            assert len(by_header) == 1 and len(by_user) == 1
            free = {(await complete(session, service, {"prompt": "x"}))["backend"] for _ in range(4)}
            assert free == {"b0", "b1"}  # no session: round-robin

    run(scenario)


def test_cache_aware_keeps_a_prefix_where_it_is_while_load_aware_moves_it() -> None:
    prefix = "You are a helpful assistant. " * 20

    async def scenario(policy: str) -> str:
        async with running(make_policy(policy, sessions="off")) as (service, backends, session):
            first = (await complete(session, service, {"prompt": prefix + "first question"}))["backend"]
            holder = next(b for b in backends if b.name == first)
            holder.gate.clear()  # a streamed request stays in flight on the holder: it is the busier one
            busy = asyncio.create_task(session.post(service.url + "/v1/completions",
                                                    json={"prompt": "other", "stream": True, "user": ""}))
            while not any(b.in_flight for b in service.backends):
                await asyncio.sleep(0.01)
            second = (await complete(session, service, {"prompt": prefix + "second question"}))["backend"]
            holder.gate.set()
            (await busy).release()
            return "same" if second == first else "moved"

    assert asyncio.run(scenario("cache-aware")) == "same"
    assert asyncio.run(scenario("least-loaded")) == "moved"


def test_streaming_is_passed_through_as_it_arrives() -> None:
    async def scenario() -> None:
        async with running(make_policy("round-robin", sessions="off"), n=1) as (service, backends, session):
            backends[0].gate.clear()  # the backend holds its second chunk back
            async with session.post(service.url + "/v1/completions", json={"prompt": "x", "stream": True}) as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 10)  # before the second exists
                assert json.loads(first[len(b"data: "):])["part"] == 1
                async with session.get(service.url + "/metrics") as m:  # its TTFT, timed at the first chunk
                    assert 'tensorcast_router_first_byte_seconds_count{backend="b0"} 1.0' in await m.text()
                backends[0].gate.set()
                rest = await r.content.read()
            assert b'"part": 2' in rest and rest.endswith(b"data: [DONE]\n\n")

    run(scenario)


def test_a_dead_backend_is_routed_around_and_none_left_is_a_typed_503() -> None:
    async def scenario() -> None:
        async with running(make_policy("round-robin", sessions="off"), extra=(dead_url(),)) as (
                service, _backends, session):
            got = {(await complete(session, service, {"prompt": f"p{i}"}))["backend"] for i in range(6)}
            assert got == {"b0", "b1"}  # every request answered, none lost to the dead one
            assert [b.alive for b in service.backends] == [True, True, False]
            async with session.post(service.url + "/v1/completions", data=b"{not json") as r:
                assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request_error"
        async with running(make_policy("round-robin", sessions="off"), n=0, extra=(dead_url(),)) as (
                service, _backends, session):
            async with session.post(service.url + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 503 and "no live" in (await r.json())["error"]["message"]
            async with session.get(service.url + "/health") as r:
                assert r.status == 503

    run(scenario)


class AlwaysLast(Router):
    def choose(self, request: Request, instances: Any) -> str:
        return [i for i in instances if i.alive][-1].instance_id


def test_a_policy_of_ones_own_plugs_in_by_name() -> None:
    register_policy("always-last", lambda seed: AlwaysLast())

    async def scenario() -> None:
        async with running(make_policy("always-last")) as (service, _backends, session):
            assert {(await complete(session, service, {"prompt": "x"}))["backend"] for _ in range(3)} == {"b1"}

    run(scenario)
    with pytest.raises(InvalidArgument, match="unknown policy"):
        make_policy("no-such")
    with pytest.raises(InvalidArgument):
        make_policy("tensorcast.no_such_module:make")


def test_what_a_policy_sees_of_a_request() -> None:
    ids = route_view({"prompt": [1, 2, 3]})
    assert (ids.session_id, ids.prompt) == ("", (1, 2, 3))
    text = route_view({"prompt": "ab", "user": "u"}, "")
    assert (text.session_id, text.prompt) == ("u", (97, 98))
    assert route_view({"prompt": "ab", "user": "u"}, "hdr").session_id == "hdr"
    chat = route_view({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    assert chat.prompt == tuple(map(ord, "user:hi\n"))
    assert route_view({"prompt": None}).prompt == ()


def test_replicas_agree_on_sessions_and_see_the_engines_load() -> None:
    async def scenario() -> None:
        async with running(make_policy("power-of-two", seed=1), n=3, health_interval=0.05) as (
                one, backends, session):
            # A second replica, its backends listed in another order, another seed: nothing shared with the first.
            other = RouterService([b.url for b in reversed(backends)], make_policy("power-of-two", seed=2))
            await other.start()
            try:
                placed: dict[str, set[str]] = {}
                for i in range(24):
                    for replica in (one, other, one):
                        body = {"prompt": "x", "user": f"user-{i}"}
                        placed.setdefault(f"user-{i}", set()).add((await complete(session, replica, body))["backend"])
                assert all(len(where) == 1 for where in placed.values()), placed
                assert len({next(iter(w)) for w in placed.values()}) == 3  # sessions spread over every backend
            finally:
                await other.stop()
            # Load the engines report (every replica's requests) steers requests without a session.
            backends[0].running, backends[1].running = 9.0, 7.0
            deadline = asyncio.get_running_loop().time() + 10
            while [b.reported for b in one.backends] != [9, 7, 0]:
                assert asyncio.get_running_loop().time() < deadline, [b.reported for b in one.backends]
                await asyncio.sleep(0.05)
            least = make_policy("least-loaded", sessions="off")
            one.policy = least
            assert {(await complete(session, one, {"prompt": "y"}))["backend"] for _ in range(3)} == {"b2"}

    run(scenario)


def test_a_replica_killed_mid_stream_leaves_the_other_replicas_clients_served(tmp_path: Any) -> None:
    import os
    import signal
    import sys

    from tensorcast.testing.tools import unused_port

    async def start_replica(urls: list[str]) -> tuple[Any, str]:
        port = unused_port()
        args = ["-m", "tensorcast", "router", "--policy", "round-robin", "--port", str(port),
                *(x for u in urls for x in ("--backend", u))]
        proc = await asyncio.create_subprocess_exec(sys.executable, *args, stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.DEVNULL)
        return proc, f"http://127.0.0.1:{port}"

    async def scenario() -> None:
        backends = [Backend("b0")]
        await backends[0].start()
        replicas = [await start_replica([backends[0].url]) for _ in range(2)]
        try:
            async with aiohttp.ClientSession() as session:
                for _proc, url in replicas:
                    deadline = asyncio.get_running_loop().time() + 30
                    while True:
                        try:
                            async with session.get(url + "/health") as r:
                                if r.status == 200:
                                    break
                        except aiohttp.ClientError:
                            pass
                        assert asyncio.get_running_loop().time() < deadline, "replica did not start"
                        await asyncio.sleep(0.1)
                backends[0].gate.clear()
                async with session.post(replicas[1][1] + "/v1/completions",
                                        json={"prompt": "x", "stream": True}) as r:
                    first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 10)
                    os.kill(replicas[0][0].pid, signal.SIGKILL)  # the other replica dies mid-stream
                    await replicas[0][0].wait()
                    backends[0].gate.set()
                    rest = await r.content.read()
                assert b'"part": 1' in first and rest.endswith(b"data: [DONE]\n\n")
                assert (await complete(session, _Url(replicas[1][1]), {"prompt": "z"}))["backend"] == "b0"
        finally:
            for proc, _url in replicas:
                if proc.returncode is None:
                    proc.terminate()
                    await proc.wait()
            await backends[0].stop()

    run(scenario)


def test_sessions_arriving_one_at_a_time_spread_over_idle_backends() -> None:
    """Agent sessions are idle between turns: with nothing in flight anywhere, least-loaded placement still
    spreads new sessions by the context each backend already holds (not all onto the first backend)."""
    async def scenario() -> None:
        async with running(make_policy("least-loaded", sessions="table"), n=2) as (service, backends, session):
            for i in range(4):  # one after another: no request is ever in flight when the next arrives
                await complete(session, service, {"prompt": "w1 w2 w3 w4", "user": f"s{i}"})
            assert [len(b.bodies) for b in backends] == [2, 2]
            for i in range(4):  # their next turns follow them
                await complete(session, service, {"prompt": "w1 w2 w3 w4 w5", "user": f"s{i}"})
            assert [len(b.bodies) for b in backends] == [4, 4]
            assert sum(service.book.resident.values()) == 4 * len("w1 w2 w3 w4 w5")

    run(scenario)


def test_idle_sessions_leave_the_book_without_a_rebalancer() -> None:
    from tensorcast.router.session_book import SessionBook

    book = SessionBook(ttl_s=10.0)
    book.started(0.0, "a", "b0", 100)
    book.finished(1.0, "a")
    book.started(5.0, "b", "b1", 7)
    assert book.resident == {"b0": 100, "b1": 7} and len(book) == 2
    book.started(12.0, "b", "b1", 9)  # a was last seen at 1.0: gone, and its context with it
    assert book.resident == {"b0": 0, "b1": 9} and len(book) == 1


class _Url:
    def __init__(self, url: str) -> None:
        self.url = url


def test_disaggregated_mode_hands_each_request_from_a_prefill_to_a_decode_backend() -> None:
    async def scenario() -> None:
        prefill = [Backend("p0"), Backend("p1")]
        for p in prefill:
            await p.start()
        try:
            async with running(make_policy("round-robin", sessions="off"), n=2,
                               prefill=[p.url for p in prefill],
                               prefill_policy=make_policy("round-robin", sessions="off")) as (
                    service, decode, session):
                for i in range(2):
                    answer = await complete(session, service, {"prompt": f"q{i}", "max_tokens": 10, "stream": False})
                    assert answer["backend"] == f"b{i}"
                    assert answer["echo"]["kv_transfer_params"] == {"tensorcast_pages": 3}
                    assert answer["echo"]["max_tokens"] == 10
                assert [len(p.bodies) for p in prefill] == [1, 1]
                assert all(p.bodies[0]["max_tokens"] == 1 and p.bodies[0]["stream"] is False for p in prefill)
                async with session.post(service.url + "/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9,
                        "stream": True, "stream_options": {"include_usage": True}}) as r:
                    text = await r.text()
                assert '"part": 2' in text and decode[0].bodies[-1]["max_completion_tokens"] == 9
                chat_leg = next(b for p in prefill for b in p.bodies if "messages" in b)
                assert chat_leg["max_completion_tokens"] == 1 and "stream_options" not in chat_leg
                for p in prefill:
                    await p.stop()
                async with session.post(service.url + "/v1/completions", json={"prompt": "x"}) as r:
                    assert r.status == 503 and "prefill" in (await r.json())["error"]["message"]
        finally:
            for p in prefill:
                await p.stop()

    run(scenario)


def test_event_cache_aware_routes_by_the_engines_kv_events() -> None:
    pytest.importorskip("zmq")
    from tensorcast.kv_event_stream import EventPublisher
    from tensorcast.kv_events import BlockStored, KVEventBatch
    from tensorcast.policies import EventFeed
    from tensorcast.router.choice import make_event_policy

    block = 4
    held = list(range(100, 132))  # 8 blocks that b1's engine reports holding

    async def scenario() -> None:
        publisher = EventPublisher("tcp://127.0.0.1:0")
        policy, index = make_event_policy(block, sessions="off")
        feed = EventFeed(index)
        feed.add_instance("b1", publisher.endpoint)
        async with running(policy, feed=feed) as (service, _backends, session):
            stored = BlockStored(block_hashes=list(range(1, 9)), parent_block_hash=None, token_ids=held,
                                 block_size=block, lora_id=None, medium="GPU", lora_name=None)
            deadline = asyncio.get_running_loop().time() + 10
            view = Request("", tuple(held))

            def held_by_b1() -> int:  # the router's event thread changes the index under the feed's lock
                with feed.lock:
                    return policy.matched_tokens(view, as_instances(service.backends))["b1"]  # type: ignore[attr-defined,no-any-return]

            while held_by_b1() < len(held):
                assert asyncio.get_running_loop().time() < deadline, "the events never reached the router"
                publisher.publish(KVEventBatch(ts=0.0, events=[stored]))  # until the subscriber has joined
                await asyncio.sleep(0.05)
            text = " ".join(f"w{t}" for t in [*held, 7, 8, 9])
            assert (await complete(session, service, {"prompt": text}))["backend"] == "b1"  # its prefix is there
            other = " ".join(f"w{t}" for t in range(300, 340))
            assert (await complete(session, service, {"prompt": other}))["backend"] == "b0"  # a miss: least loaded
        publisher.close()

    run(scenario)


def test_the_rebalancer_moves_idle_sessions_off_the_busier_backend() -> None:
    from tensorcast.policies import Rebalancer
    from tensorcast.router.choice import HashedSessions

    async def scenario() -> None:
        async with running(make_policy("round-robin"), rebalancer=Rebalancer(interval_s=0.05, cooldown_s=60)) as (
                service, _backends, session):
            hashed = HashedSessions(make_policy("round-robin", sessions="off"))
            instances = as_instances(service.backends)
            on_b0 = [s for s in (f"s{i}" for i in range(100))
                     if hashed.choose(Request(s, ()), instances) == "b0"][:4]  # all four placed on b0
            for s in on_b0:
                assert (await complete(session, service, {"prompt": "x" * 64, "user": s}))["backend"] == "b0"
            deadline = asyncio.get_running_loop().time() + 100 * 0.05
            while service.book.moves < 2:  # 4 vs 0: two moves even it out, then it stops
                assert asyncio.get_running_loop().time() < deadline, service.book.moves
                await asyncio.sleep(0.05)
            await asyncio.sleep(5 * 0.05)
            assert service.book.moves == 2  # no move back and forth
            where = [(await complete(session, service, {"prompt": "x" * 80, "user": s}))["backend"] for s in on_b0]
            assert sorted(where) == ["b0", "b0", "b1", "b1"]
            async with session.get(service.url + "/metrics") as r:
                assert "tensorcast_router_session_moves_total 2.0" in await r.text()

    run(scenario)
