"""The dashboard in headless Chromium while a workload runs: the numbers on the page are list_workers()'s.
Saves a screenshot (``TENSORCAST_TEST_ARTIFACTS``, default ``test-artifacts/``)."""

from __future__ import annotations

import os
import threading
import time
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import numpy as np

import tensorcast as tc
from tensorcast.testing import running_cluster

from .conftest import system_tool

HEARTBEAT = 0.5
REFRESH = 0.5
# Chromium flags for a machine with no network beyond loopback and no display.
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _page_workers(page: Any) -> dict[str, dict[str, list[str]]]:
    """Each worker row's cells: field -> [data-value, visible text]; the memory cell's capacity as its own field."""
    return page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('#workers tr[data-worker]')]
        .map(tr => [tr.dataset.worker, Object.fromEntries([...tr.querySelectorAll('td[data-field]')]
        .flatMap(td => [[td.dataset.field, [td.dataset.value, td.textContent]]].concat(td.dataset.capacity
            === undefined ? [] : [[td.dataset.field.replace('used', 'capacity'), [td.dataset.capacity, '']]])))
        ]))""")


def _wait_until(page: Any, expression: str, timeout: float) -> None:
    """Polls a JavaScript expression until it is true (bounded). Not Playwright's ``wait_for_function``: its
    polling evaluates a string inside the page, which the dashboard's Content-Security-Policy (no 'unsafe-eval')
    rightly refuses; ``evaluate`` goes through the debugging protocol, so the page keeps its policy."""
    deadline = time.monotonic() + timeout
    while not page.evaluate(f"() => Boolean({expression})"):
        assert time.monotonic() < deadline, f"not true within {timeout} s: {expression}"
        time.sleep(REFRESH / 4)


def _recorded(client: tc.Client) -> dict[str, dict[str, str]]:
    return {w.worker_id: {"memory_used": str(w.memory_used), "memory_capacity": str(w.memory_capacity),
                          "artifacts": str(w.artifacts), "alive": "true" if w.alive else "false"}
            for w in client.list_workers()}


def _bytes(n: float) -> str:
    """The page's ``bytes()``: binary units, one decimal (JavaScript's ``toFixed`` rounds halves up)."""
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    i = 0
    while abs(n) >= 1024 and i < len(units) - 1:
        n /= 1024
        i += 1
    shown = str(Decimal(n).quantize(Decimal("0.1"), ROUND_HALF_UP)) if i else str(int(n))
    return f"{shown} {units[i]}"


def _workload(client: tc.Client, stop: threading.Event, put: list[tc.Artifact]) -> None:
    rng = np.random.default_rng(1)
    i = 0
    while not stop.is_set():
        art = client.put({"t": rng.random((64, 1024), dtype=np.float32)}, key=f"dash/{i}")
        art.prefetch(to="w1").result(timeout=30)
        put.append(art)
        i += 1


def _shows_list_workers(page: Any, client: tc.Client) -> None:
    stop = threading.Event()
    put: list[tc.Artifact] = []
    worker = threading.Thread(target=_workload, args=(client, stop, put))
    worker.start()
    try:
        # While it runs the page keeps updating and shows the artifacts arriving.
        _wait_until(page, "Number(document.body.dataset.updates) >= 4", 30)
        _wait_until(page, "Number(document.querySelector('[data-field=artifacts_total]').dataset.value) >= 3", 60)
    finally:
        stop.set()
        worker.join(timeout=60)
    # Once the heartbeats have carried the final state, the page shows exactly what callers see.
    deadline = time.monotonic() + 40 * max(HEARTBEAT, REFRESH)
    while True:
        want = _recorded(client)
        cells = _page_workers(page)
        shown = {w: {k: v[k][0] for k in want[w]} for w, v in cells.items() if w in want}
        if shown == want and int(want["w1"]["artifacts"]) == len(put):
            break
        assert time.monotonic() < deadline, (shown, want, len(put))
        time.sleep(REFRESH)
    for v in cells.values():  # what a person reads is the same number
        assert v["artifacts"][1] == v["artifacts"][0]
        assert v["memory_used"][1] == f"{_bytes(int(v['memory_used'][0]))} / {_bytes(int(v['memory_capacity'][0]))}"
    assert {v["memory_capacity"][0] for v in cells.values()} == {str(256 * 2**20)}
    total = page.get_attribute("[data-field=artifacts_total]", "data-value")
    assert total == str(len(put))
    prefix = page.get_attribute("#artifacts tr[data-prefix='dash/'] td[data-field=keys]", "data-value")
    assert prefix == str(len(put))


def test_dashboard_shows_list_workers() -> None:
    chromium = system_tool("chromium", "chromium")
    from playwright.sync_api import sync_playwright

    out = Path(os.environ.get("TENSORCAST_TEST_ARTIFACTS", "test-artifacts"))
    shot = out / "dashboard.png"
    config = {"worker.heartbeat_interval": HEARTBEAT, "metrics.dashboard_refresh": REFRESH}
    with running_cluster(workers=2, memory_capacity="256MiB", config=config) as cluster, \
            tc.connect(cluster.address) as client, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            try:
                page.goto(cluster.dashboard_url)
                _wait_until(page, "Number(document.body.dataset.updates || 0) >= 1", 30)
                _shows_list_workers(page, client)
            finally:  # a failing run leaves its screenshot too: what the page showed then
                out.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
