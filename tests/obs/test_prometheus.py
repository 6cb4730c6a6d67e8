"""A real Prometheus server scrapes a token-protected cluster while it works; its HTTP API then reports the
series and values the cluster's callers can check themselves."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorcast as tc
from tensorcast.testing import running_cluster
from tensorcast.testing.tools import unused_port

from .conftest import system_tool

SCRAPE = 0.5  # seconds between scrapes
TOKEN = "prom-s3cret"


@pytest.fixture()
def prometheus(tmp_path: Path) -> Iterator[Any]:
    binary = system_tool("prometheus", "prometheus")

    def start(targets: dict[str, str]) -> str:
        static = "\n".join(f"      - targets: ['{url.removeprefix('http://')}']\n        labels: {{process: '{name}'}}"
                           for name, url in targets.items())
        (tmp_path / "prometheus.yml").write_text(f"""
global:
  scrape_interval: {int(SCRAPE * 1000)}ms
  scrape_timeout: {int(SCRAPE * 1000)}ms
scrape_configs:
  - job_name: tensorcast
    authorization:
      type: Bearer
      credentials: {TOKEN}
    static_configs:
{static}
""")
        port = unused_port()
        proc = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("wb"))
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return url
            except OSError:
                pass
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "prometheus not ready after 60 s"
            time.sleep(0.2)

    procs: list[subprocess.Popen[bytes]] = []
    yield start
    for p in procs:
        p.terminate()
        p.wait(timeout=20)


def query(url: str, promql: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}",
                                timeout=10) as r:
        reply = json.loads(r.read())
    assert reply["status"] == "success", reply
    return list(reply["data"]["result"])


def wait_for(url: str, promql: str, expected: float, scrapes: int = 40) -> float:
    """Poll ``promql`` until its single value equals ``expected``, for at most ``scrapes`` scrape intervals."""
    deadline = time.monotonic() + scrapes * SCRAPE
    got: float | None = None
    while time.monotonic() < deadline:
        result = query(url, promql)
        if len(result) == 1:
            got = float(result[0]["value"][1])
            if got == expected:
                return got
        time.sleep(SCRAPE / 2)
    raise AssertionError(f"{promql} = {got}, expected {expected}")


def test_prometheus_scrapes_what_was_done(prometheus: Any) -> None:
    with running_cluster(workers=2, memory_capacity="256MiB", token=TOKEN,
                         config={"worker.heartbeat_interval": SCRAPE}) as cluster, \
            tc.connect(cluster.address, TOKEN) as client:
        prom = prometheus(cluster.metrics_urls)
        wait_for(prom, 'count(up{job="tensorcast"} == 1)', 3)  # the token got every scrape through

        rng = np.random.default_rng(0)
        put = 0
        for i in range(12):
            art = client.put({"t": rng.integers(0, 255, 1000 * (i + 1), dtype=np.uint8)}, key=f"prom/{i}")
            put += art.nbytes
        client.artifact("prom/3").prefetch(to="w1").result(timeout=30)
        moved = client.artifact("prom/3").nbytes

        wait_for(prom, 'sum(tensorcast_operation_bytes_total{op="put"})', put)
        wait_for(prom, 'sum(tensorcast_operations_total{op="put",outcome="ok"})', 12)
        wait_for(prom, 'sum(tensorcast_operation_bytes_total{op="transfer",process="w1"})', moved)
        wait_for(prom, 'tensorcast_gs_artifacts{process="gs"}', 12)
        # The pool gauge (slot bytes: small tensors round up to their slab class) agrees with list_workers(),
        # which the heartbeats feed, once both have caught up with the quiet cluster.
        deadline = time.monotonic() + 40 * SCRAPE
        while True:
            used = sum(w.memory_used for w in client.list_workers())
            gauge = query(prom, 'sum(tensorcast_pool_bytes{tier="memory",state="used"})')
            if gauge and float(gauge[0]["value"][1]) == used >= put + moved:
                break
            assert time.monotonic() < deadline, (used, gauge, put + moved)
            time.sleep(SCRAPE / 2)
        # Global-store request latency, as an operator would chart it.
        p99 = query(prom, 'histogram_quantile(0.99, sum by (le) '
                          '(rate(tensorcast_rpc_sent_seconds_bucket{peer="gs"}[1m])))')
        assert len(p99) == 1 and 0 < float(p99[0]["value"][1]) < 60
