"""``docs/metrics.md`` and the code agree: every series a process serves is documented there with its type,
labels and label values, and every documented series is one the code declares (whether or not it has samples
yet). Also what an engine instance serves, and that every listing of metrics URLs includes it."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import tensorcast as tc
from tensorcast.testing import running_cluster

from .conftest import scrape, value

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "metrics.md"
SRC = ROOT / "src" / "tensorcast"
STUBS = Path(__file__).resolve().parent / "stubs"
NAME = re.compile(r"tensorcast_[a-z0-9_]+")


@dataclass
class Family:
    type: str
    labels: dict[str, set[str]] = field(default_factory=dict)  # label -> its values (documented: those listed)


def _base(name: str) -> str:
    """A family's name as the text format's parser gives it: a counter's without ``_total``."""
    return name.removesuffix("_total")


def _doc_labels(cell: str) -> dict[str, set[str]]:
    """``worker``, ``tier`` (``memory``, ``disk``): each label, with the values listed after it, if any."""
    return {m[1]: set(re.findall(r"`([^`]+)`", m[2] or "")) for m in re.finditer(r"`(\w+)`(?:\s*\(([^)]*)\))?", cell)}


def documented() -> dict[str, Family]:
    """The series tables of ``docs/metrics.md`` (a table without a labels column documents no labels)."""
    out: dict[str, Family] = {}
    for line in DOC.read_text().splitlines():
        if not line.startswith("| `tensorcast_"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        labels = _doc_labels(cells[2]) if len(cells) == 4 else {}
        for name in re.findall(rf"`({NAME.pattern})`", cells[0]):
            out[_base(name)] = Family(cells[1], labels)
    return out


def _records_metrics(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module == "tensorcast.obs.metrics" or (
                node.module == "tensorcast.obs" and any(a.name == "metrics" for a in node.names))):
            return True
    return False


def declared() -> set[str]:
    """Every ``tensorcast_*`` name in the modules that define or report metrics: the event families of
    ``obs.metrics`` and the gauges each role's sources report, found in the source, not in a scrape."""
    names: set[str] = set()
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text())
        if path == SRC / "obs" / "metrics.py" or _records_metrics(tree):
            names |= {_base(n.value) for n in ast.walk(tree)
                      if isinstance(n, ast.Constant) and isinstance(n.value, str) and NAME.fullmatch(n.value)}
    return names


def served(url: str) -> dict[str, Family]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out: dict[str, Family] = {}
    for fam in text_string_to_metric_families(text):
        found = out[fam.name] = Family(fam.type)
        for s in fam.samples:
            for k, v in s.labels.items():
                if k != "le":
                    found.labels.setdefault(k, set()).add(v)
    return out


def test_documented_series_are_the_declared_ones() -> None:
    docs, code = set(documented()), declared()
    assert len(code) > 20  # the scan found the families (an import renamed would make it find none)
    assert docs - code == set(), "documented in docs/metrics.md but declared nowhere in the code"
    assert code - docs == set(), "declared in the code but not documented in docs/metrics.md"


def _check_served(process: str, families: dict[str, Family], docs: dict[str, Family]) -> None:
    for name, fam in families.items():
        assert name in docs, f"{process} serves {name}, which docs/metrics.md does not list"
        doc = docs[name]
        assert fam.type == doc.type, f"{name}: served as a {fam.type}, documented as a {doc.type}"
        if fam.labels:  # a family with no samples yet shows no labels
            assert set(fam.labels) == set(doc.labels), f"{name}: labels {sorted(fam.labels)}"
        for label, listed in doc.labels.items():
            if listed and label in fam.labels:
                # A gauge reports every value at each scrape: the doc lists exactly those. Counters and
                # histograms show only the values that have happened so far.
                shown = fam.labels[label]
                assert shown == listed if fam.type == "gauge" else shown <= listed, (name, label, shown)


def test_every_process_serves_documented_series_and_lists_instances(monkeypatch: pytest.MonkeyPatch) -> None:
    # The instance process finds its module on PYTHONPATH (it is a test stand-in, not part of the package).
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(STUBS), os.environ.get("PYTHONPATH", "")) if p))
    with running_cluster(workers=1) as cluster, tc.connect(cluster.address) as client:
        cluster.start_instance("idle-1", "w0", module="idle_instance")
        art = client.put({"t": np.arange(1000, dtype=np.float32)}, key="docs/a")
        art.prefetch(to="w0").result(timeout=30)
        urls = cluster.metrics_urls
        assert set(urls) == {"gs", "w0", "idle-1"} and len(set(urls.values())) == 3
        assert client.metrics_urls() == urls

        docs = documented()
        per = {name: served(url) for name, url in urls.items()}
        for name, families in per.items():
            _check_served(name, families, docs)
        assert "tensorcast_pool_bytes" in per["w0"] and "tensorcast_gs_workers" in per["gs"]
        instance = scrape(urls["idle-1"])
        want = {("requests", "running"): 1, ("requests", "waiting"): 2, ("kv_tokens", "used"): 3,
                ("kv_tokens", "capacity"): 64}  # the stand-in's fixed load
        for (series, state), n in want.items():
            assert value(instance, f"tensorcast_instance_{series}", instance="idle-1", state=state) == n
        assert value(instance, "tensorcast_rpc_sent_total", method="RegisterInstance", outcome="ok") >= 1

        status = subprocess.run([sys.executable, "-m", "tensorcast", "status", "--json", "--address",
                                 cluster.address], capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["metrics_urls"] == urls
