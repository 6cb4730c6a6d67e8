from __future__ import annotations

import urllib.request
from collections import defaultdict

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


def system_tool(path: str, package: str) -> str:
    """A Debian tool the test drives (CI installs it). Without it the test is skipped, saying how to install
    it, except where TENSORCAST_REQUIRE_SYSTEM_TOOLS=1 (CI) makes its absence a failure."""
    import os
    import shutil

    import pytest

    found = shutil.which(path)
    if found:
        return found
    why = f"{path} not found: apt-get install {package}"
    if os.environ.get("TENSORCAST_REQUIRE_SYSTEM_TOOLS") == "1":
        pytest.fail(why)
    pytest.skip(why)
