"""Backends found in the cluster: engine servers announce themselves in ``list_instances()``
(``instance.announce``, which the vLLM connector runs with an ``advertise_url``), and ``tensorcast router
--discover`` routes to them as they come; a global store that cannot be asked takes no backend out of service."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp")

import tensorcast as tc  # noqa: E402
from tensorcast.credentials import Keyring  # noqa: E402
from tensorcast.errors import InvalidArgument, Unavailable  # noqa: E402
from tensorcast.instance.announce import Announcement  # noqa: E402
from tensorcast.records import InstanceInfo, WorkerInfo  # noqa: E402
from tensorcast.router import RouterService, make_policy  # noqa: E402
from tensorcast.router.choice import BackendLoad  # noqa: E402
from tensorcast.router.discovery import Discovery, backend_urls, reconcile  # noqa: E402
from tensorcast.testing import running_cluster  # noqa: E402

from .conftest import Backend, complete, run  # noqa: E402

LIVENESS = 2.0  # gs.worker_liveness_timeout here
BEAT = 0.2  # the announcements' interval


def test_backends_are_the_alive_instances_that_serve_http() -> None:
    def rec(i: str, address: str, alive: bool = True, engine: str = "vllm") -> InstanceInfo:
        return InstanceInfo(instance_id=i, address=address, home_worker="", alive=alive, engine=engine)

    records = [rec("a", "http://10.0.0.1:8000/"), rec("b", "tcp://10.0.0.2:7000"),  # an instance TensorCast runs
               rec("c", "http://10.0.0.3:8000", alive=False), rec("d", "https://e:443", engine="sglang"),
               rec("e", "http://10.0.0.1:8000")]
    assert backend_urls(records) == ["http://10.0.0.1:8000", "https://e:443"]
    assert backend_urls(records, engine="vllm") == ["http://10.0.0.1:8000"]
    with pytest.raises(InvalidArgument):
        Announcement("127.0.0.1:1", "10.0.0.1:8000", engine="vllm")  # not a URL: refused before anything is sent


def test_a_discovered_backend_is_dropped_only_once_unlisted_down_and_idle() -> None:
    given, found, busy = BackendLoad("b0", "http://a"), BackendLoad("b1", "http://b"), BackendLoad("b2", "http://c")
    found.alive = busy.alive = given.alive = False
    busy.in_flight = 1  # a request still on it: it stays until that ends
    added, dropped = reconcile([given, found, busy], ["http://d", "http://a", "http://d"], {"http://b", "http://c"})
    assert added == ["http://d"] and dropped == [found]  # given by hand: stays, down or not
    found.alive = True
    assert reconcile([found], [], {"http://b"}) == ([], [])  # unlisted but up: its health decides, not the list


@pytest.mark.timeout(120)
def test_the_router_finds_engines_as_they_announce_and_routes_around_one_that_stops() -> None:
    with running_cluster(workers=1, config={"gs.worker_liveness_timeout": LIVENESS}) as cluster, \
            tc.connect(cluster.address) as client:

        async def scenario() -> None:
            b0, b1 = Backend("b0"), Backend("b1")
            await b0.start()
            await b1.start()
            first = Announcement(cluster.address, b0.url, engine="vllm", interval=BEAT)
            deadline = time.monotonic() + LIVENESS
            while not backend_urls(client.list_instances()):  # registered with its first beat
                assert time.monotonic() < deadline
                await asyncio.sleep(BEAT)
            service = RouterService([], make_policy("round-robin", sessions="off"), health_interval=BEAT,
                                    discovery=Discovery(cluster.address))
            await service.start()  # discovers b0 before it serves
            second = Announcement(cluster.address, b1.url, engine="vllm", interval=BEAT)
            try:
                async with aiohttp.ClientSession() as http:
                    assert (await complete(http, service, {"prompt": "x"}))["backend"] == "b0"
                    deadline = time.monotonic() + LIVENESS + 5 * BEAT
                    seen: set[str] = set()
                    while seen != {"b0", "b1"}:  # b1 found at a health check after its announcement
                        assert time.monotonic() < deadline, seen
                        seen.add((await complete(http, service, {"prompt": "x"}))["backend"])
                        await asyncio.sleep(BEAT / 2)
                    second.stop()
                    await b1.stop()  # the engine gone: answered by b0 alone, not one request lost
                    answers = [(await complete(http, service, {"prompt": "x"}))["backend"] for _ in range(6)]
                    assert answers == ["b0"] * 6
                    deadline = time.monotonic() + LIVENESS + 5 * BEAT
                    while b1.url in backend_urls(client.list_instances()):  # its record stops being alive
                        assert time.monotonic() < deadline
                        await asyncio.sleep(BEAT)
                    deadline = time.monotonic() + 5 * BEAT
                    while [b.url for b in service.backends] != [b0.url]:  # unlisted and down: dropped
                        assert time.monotonic() < deadline
                        await asyncio.sleep(BEAT)
            finally:
                first.stop()
                await service.stop()
                await b0.stop()

        run(scenario)


def test_only_the_worker_role_may_list_an_engine_for_routers() -> None:
    """Routers send users' requests to what ``list_instances()`` lists: a client credential cannot put an
    engine there (its announcement is refused and ends), a worker credential can."""
    keys = Keyring.from_token("s3cret")
    assert keys is not None
    with running_cluster(workers=1, token="s3cret") as cluster, \
            tc.connect(cluster.address, token=keys.credential("read-only")) as reader:
        refused = Announcement(cluster.address, "http://127.0.0.1:9", engine="vllm", interval=BEAT,
                               token=keys.credential("client"))
        listed = Announcement(cluster.address, "http://127.0.0.1:10", engine="vllm", interval=BEAT,
                              token=keys.credential("worker"))
        try:
            deadline = time.monotonic() + LIVENESS
            while not backend_urls(reader.list_instances()):
                assert time.monotonic() < deadline
                time.sleep(BEAT)
            time.sleep(3 * BEAT)  # the refused one had as many beats to get in
            assert backend_urls(reader.list_instances()) == ["http://127.0.0.1:10"]
        finally:
            refused.stop()
            listed.stop()


class Unreachable(Discovery):
    """A cluster that answers once, then cannot be asked (a global store blip), or its client fails (a bug)."""

    def __init__(self, urls: list[str]) -> None:
        super().__init__("unused:1")
        self.urls: list[str] | None = urls
        self.asked = 0

    async def survey(self) -> tuple[list[InstanceInfo], list[WorkerInfo]]:
        self.asked += 1
        urls, self.urls = self.urls, None
        if urls is None:
            raise Unavailable("global store unreachable") if self.asked % 2 else RuntimeError("a bug")
        return [InstanceInfo(instance_id=f"i{n}", address=u, home_worker="w0") for n, u in enumerate(urls)], []


def test_a_cluster_that_cannot_be_asked_leaves_the_backends_known_in_service() -> None:
    async def scenario() -> None:
        b0 = Backend("b0")
        await b0.start()
        discovery = Unreachable([b0.url])
        service = RouterService([], make_policy("round-robin", sessions="off"), health_interval=0.05,
                                discovery=discovery)
        await service.start()
        try:
            async with aiohttp.ClientSession() as http:
                while discovery.asked < 4:  # health checks go on, the cluster refusing every time
                    await asyncio.sleep(0.05)
                answers: list[Any] = [(await complete(http, service, {"prompt": "x"}))["backend"] for _ in range(3)]
                assert answers == ["b0"] * 3
                async with http.get(service.url + "/health") as r:
                    assert r.status == 200
        finally:
            await service.stop()
            await b0.stop()

    run(scenario)


class _Listed(Discovery):
    """A cluster that lists one announced server, with its home worker, at every survey."""

    def __init__(self, url: str) -> None:
        super().__init__("unused:1", adds_backends=False)
        self.url, self.asked = url, 0

    async def survey(self) -> tuple[list[InstanceInfo], list[WorkerInfo]]:
        self.asked += 1
        return [InstanceInfo(instance_id="i0", address=self.url, home_worker="w7")], []


def test_a_policy_failing_on_the_topology_stops_no_health_check() -> None:
    """``Router.set_topology`` is a user's hook: one that raises is logged, and the router's surveys and health
    checks (which bring a backend that failed a request back into service) go on."""
    from tensorcast.policies import Router

    class Faulty(Router):
        def choose(self, request: Any, instances: Any) -> str:
            return str(instances[0].instance_id)

        def set_topology(self, workers: Any) -> None:
            raise RuntimeError("a bug in a policy of one's own")

    async def scenario() -> None:
        b0 = Backend("b0")
        await b0.start()
        discovery = _Listed(b0.url)
        service = RouterService([b0.url], Faulty(), health_interval=0.05, discovery=discovery)
        await service.start()  # the first survey's failure does not fail the start
        try:
            service.backends[0].alive = False  # as after a failed request: a health check brings it back
            while discovery.asked < 4 or not service.backends[0].alive:
                await asyncio.sleep(0.05)
            async with aiohttp.ClientSession() as http:
                assert (await complete(http, service, {"prompt": "x"}))["backend"] == "b0"
        finally:
            await service.stop()
            await b0.stop()

    run(scenario)


def test_a_router_without_backends_or_a_cluster_is_refused() -> None:
    with pytest.raises(InvalidArgument):
        RouterService([], make_policy("round-robin"))
