from __future__ import annotations

import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable
from typing import TypeVar

from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str, token: str | None = None) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``url``/metrics parsed: sample name -> [(labels, value)]."""
    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=10) as reply:
        text = reply.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name].append((s.labels, s.value))
    return out


def value(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when there is none)."""
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == want for k, want in labels.items()))


T = TypeVar("T")


def eventually(probe: Callable[[], T], done: Callable[[T], bool], timeout: float, every: float = 0.05) -> T:
    """``probe()`` once ``done`` holds for it, polling until ``timeout`` seconds have passed; then the last value
    fails the test. For counters a process updates just after its reply has gone out."""
    deadline = time.monotonic() + timeout
    while True:
        got = probe()
        if done(got):
            return got
        assert time.monotonic() < deadline, f"still {got!r} after {timeout:g} s"
        time.sleep(every)


def system_tool(path: str, package: str) -> str:
    from tensorcast.testing.tools import require_tool

    return require_tool(path, package)
