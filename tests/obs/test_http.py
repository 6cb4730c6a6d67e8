"""The HTTP endpoint every process serves: routes, refusals, and the cluster token."""

from __future__ import annotations

import asyncio
import base64

import pytest

from tensorcast.obs import metrics
from tensorcast.obs.http import HttpServer, Response


async def _get(url: str, path: str, headers: dict[str, str] | None = None, method: str = "GET",
               raw: bytes | None = None) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    head = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    request = f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n{head}\r\n"
    writer.write(raw if raw is not None else request.encode())
    await writer.drain()
    data = await reader.read()
    writer.close()
    status_line, _, rest = data.partition(b"\r\n")
    body = rest.partition(b"\r\n\r\n")[2]
    return int(status_line.split()[1]), body


def _run(coro_fn, token: str | None = None):  # type: ignore[no-untyped-def]
    async def main():  # type: ignore[no-untyped-def]
        async def hello(query: str) -> Response:
            return Response(f"hello {query}".encode())

        server = HttpServer(token, {"/hello": hello})
        url = await server.start("127.0.0.1", 0)
        try:
            return await coro_fn(url)
        finally:
            await server.close()

    return asyncio.run(main())


def test_routes_and_refusals() -> None:
    metrics.rpc_served("TestProbe", "ok", 0.001)

    async def check(url: str) -> None:
        status, body = await _get(url, "/metrics")
        assert status == 200 and b'tensorcast_rpc_served_total{method="TestProbe",outcome="ok"}' in body
        assert await _get(url, "/healthz") == (200, b"ok\n")
        assert await _get(url, "/hello?x=1") == (200, b"hello x=1")
        assert (await _get(url, "/nothing"))[0] == 404
        assert (await _get(url, "/metrics", method="POST"))[0] == 405
        assert (await _get(url, "", raw=b"garbage\r\n\r\n"))[0] == 400
        # A head larger than the limit is refused without being read whole.
        big = b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n"
        assert (await _get(url, "", raw=big))[0] == 400
        assert (await _get(url, "/healthz"))[0] == 200  # still serving

    _run(check)


@pytest.mark.parametrize("auth,expected", [
    ({}, 401),
    ({"Authorization": "Bearer wrong"}, 401),
    ({"Authorization": "Basic " + base64.b64encode(b"prometheus:wrong").decode()}, 401),
    ({"Authorization": "Basic !!!"}, 401),
    ({"Authorization": "Bearer s3cret"}, 200),
    ({"Authorization": "Basic " + base64.b64encode(b"anyone:s3cret").decode()}, 200),
])
def test_cluster_token_required(auth: dict[str, str], expected: int) -> None:
    async def check(url: str) -> None:
        status, body = await _get(url, "/metrics", auth)
        assert status == expected
        assert (await _get(url, "/healthz"))[0] == 200  # liveness probes need no token
        if expected == 401:
            assert b"tensorcast_" not in body  # nothing but the refusal

    _run(check, token="s3cret")


def test_disabled_metrics_record_nothing() -> None:
    before = metrics.exposition().count(b'method="DisabledProbe"')
    metrics.set_enabled(False)
    try:
        metrics.rpc_served("DisabledProbe", "ok", 0.001)
        metrics.operation("put", "shm", 10, 0.1)
    finally:
        metrics.set_enabled(True)
    assert metrics.exposition().count(b'method="DisabledProbe"') == before == 0


def test_histogram_buckets_are_cumulative_and_inclusive() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from tensorcast.obs.families import Histogram

    h = Histogram("probe_seconds", "probe", ["op"], (0.1, 1.0))
    for amount in (0.05, 0.1, 0.5, 1.0, 7.0):  # a value equal to a bound falls in that bucket (le)
        h.observe(("x",), amount)
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(h)
    samples = {(s.name, s.labels.get("le")): s.value
               for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    assert samples[("probe_seconds_bucket", "0.1")] == 2
    assert samples[("probe_seconds_bucket", "1.0")] == 4
    assert samples[("probe_seconds_bucket", "+Inf")] == 5
    assert samples[("probe_seconds_count", None)] == 5 and abs(samples[("probe_seconds_sum", None)] - 8.65) < 1e-9
