"""The dashboard in headless Chromium while a workload runs: the numbers on the page are list_workers()'s.
Saves a screenshot (``TENSORCAST_TEST_ARTIFACTS``, default ``test-artifacts/``)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np

import tensorcast as tc
from tensorcast.testing import running_cluster

from .conftest import system_tool

HEARTBEAT = 0.5
REFRESH = 0.5
# Chromium flags for a machine with no network beyond loopback and no display.
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _page_workers(page: object) -> dict[str, dict[str, str]]:
    return page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('#workers tr[data-worker]')]
        .map(tr => [tr.dataset.worker, Object.fromEntries([...tr.querySelectorAll('td[data-field]')]
        .map(td => [td.dataset.field, td.dataset.value])) ]))""")  # type: ignore[attr-defined, no-any-return]


def _recorded(client: tc.Client) -> dict[str, dict[str, str]]:
    return {w.worker_id: {"memory_used": str(w.memory_used), "artifacts": str(w.artifacts),
                          "alive": "true" if w.alive else "false"} for w in client.list_workers()}


def test_dashboard_shows_list_workers(tmp_path: Path) -> None:
    chromium = system_tool("chromium", "chromium")
    from playwright.sync_api import sync_playwright

    config = {"worker.heartbeat_interval": HEARTBEAT, "metrics.dashboard_refresh": REFRESH}
    with running_cluster(workers=2, memory_capacity="256MiB", config=config) as cluster, \
            tc.connect(cluster.address) as client, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(cluster.dashboard_url)
            page.wait_for_function("Number(document.body.dataset.updates || 0) >= 1", timeout=30_000)

            stop = threading.Event()
            put = []

            def workload() -> None:
                rng = np.random.default_rng(1)
                i = 0
                while not stop.is_set():
                    art = client.put({"t": rng.random((64, 1024), dtype=np.float32)}, key=f"dash/{i}")
                    art.prefetch(to="w1").result(timeout=30)
                    put.append(art)
                    i += 1

            worker = threading.Thread(target=workload)
            worker.start()
            try:
                # While it runs the page keeps updating and shows the artifacts arriving.
                page.wait_for_function("Number(document.body.dataset.updates) >= 4", timeout=30_000)
                page.wait_for_function(
                    "Number(document.querySelector('[data-field=artifacts_total]').dataset.value) >= 3",
                    timeout=60_000)
            finally:
                stop.set()
                worker.join(timeout=60)
            # Once the heartbeats have carried the final state, the page shows exactly what callers see.
            deadline = time.monotonic() + 40 * max(HEARTBEAT, REFRESH)
            while True:
                want = _recorded(client)
                shown = {w: {k: v[k] for k in ("memory_used", "artifacts", "alive")}
                         for w, v in _page_workers(page).items()}
                if shown == want and int(want["w1"]["artifacts"]) == len(put):
                    break
                assert time.monotonic() < deadline, (shown, want, len(put))
                time.sleep(REFRESH)
            total = page.get_attribute("[data-field=artifacts_total]", "data-value")
            assert total == str(len(put))
            prefix = page.get_attribute("#artifacts tr[data-prefix='dash/'] td[data-field=keys]", "data-value")
            assert prefix == str(len(put))
            out = Path(os.environ.get("TENSORCAST_TEST_ARTIFACTS", "test-artifacts"))
            out.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(out / "dashboard.png"), full_page=True)
            assert (out / "dashboard.png").stat().st_size > 10_000
        finally:
            browser.close()
