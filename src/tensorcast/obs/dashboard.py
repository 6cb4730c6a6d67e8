"""What the dashboard shows: one view of the cluster built from the same records callers get from
``list_workers()``, ``list_instances()`` and ``list_shards()``.

Owns: ``cluster_view`` (records in, a JSON-ready dict out: no sockets, files or clocks; the time is passed
in), which the global store serves at ``/api/state`` and ``tensorcast status --watch|--json`` prints, and the
page (``dashboard.html``: plain HTML and JavaScript, no build step) that renders it live. Does not own:
fetching the records or serving the page.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from collections.abc import Iterable, Sequence
from importlib import resources
from typing import Any

import msgspec

from tensorcast.records import InstanceInfo, ShardLease, WorkerInfo

__all__ = ["cluster_view", "key_prefix", "page", "page_csp"]


def key_prefix(key: str) -> str:
    """The group a key is shown under: its first path segment (``demo/``), else its name before a version
    (``m@``), else the key itself."""
    head, slash, _ = key.partition("/")
    if slash:
        return head + "/"
    name, at, _ = key.partition("@")
    return name + "@" if at else key


def _worker(w: WorkerInfo) -> dict[str, Any]:
    return {
        "id": w.worker_id, "host": w.host_id, "address": w.address, "roles": list(w.roles), "alive": w.alive,
        **msgspec.structs.asdict(w.load),
        "memory_pressure": w.memory_used / w.memory_capacity if w.memory_capacity else 0.0,
        "metrics_url": w.metrics_url, "last_heartbeat": w.last_heartbeat,
    }


def _instance(i: InstanceInfo) -> dict[str, Any]:
    return {"id": i.instance_id, "engine": i.engine, "home_worker": i.home_worker, "running": i.running,
            "waiting": i.waiting, "load": i.running + i.waiting, "kv_tokens_used": i.kv_tokens_used,
            "kv_tokens_capacity": i.kv_tokens_capacity, "alive": i.alive}


def _shards(num_shards: int, leases: Sequence[ShardLease], now: float) -> dict[str, Any]:
    by_holder: dict[str, dict[str, Any]] = {}
    held = 0
    for lease in leases:
        if not lease.holder or lease.expiry <= now:
            continue
        held += 1
        entry = by_holder.setdefault(lease.holder, {"holder": lease.holder, "shards": 0, "max_token": 0})
        entry["shards"] += 1
        entry["max_token"] = max(entry["max_token"], lease.token)
    return {"num_shards": num_shards, "held": held, "vacant": num_shards - held,
            "by_holder": sorted(by_holder.values(), key=lambda e: e["holder"])}


def _artifacts(keys: Iterable[tuple[str, int]], total: int) -> dict[str, Any]:
    groups: dict[str, dict[str, Any]] = {}
    for key, nbytes in keys:
        prefix = key_prefix(key)
        g = groups.setdefault(prefix, {"prefix": prefix, "keys": 0, "bytes": 0})
        g["keys"] += 1
        g["bytes"] += nbytes
    return {"total": total, "by_prefix": sorted(groups.values(), key=lambda g: (-g["bytes"], g["prefix"]))}


def cluster_view(workers: Sequence[WorkerInfo], instances: Sequence[InstanceInfo], num_shards: int,
                 leases: Sequence[ShardLease], keys: Iterable[tuple[str, int]], artifacts_total: int,
                 now: float) -> dict[str, Any]:
    """The dashboard's state. ``keys``: (key, artifact bytes) pairs; ``now``: the global store's clock."""
    alive = [w for w in workers if w.alive]
    totals = {
        "workers": len(workers), "workers_alive": len(alive),
        "memory_used": sum(w.memory_used for w in alive), "memory_capacity": sum(w.memory_capacity for w in alive),
        "net_in_bps": sum(w.net_in_bps for w in alive), "net_out_bps": sum(w.net_out_bps for w in alive),
        "transfers_in_flight": sum(w.transfers_in_flight for w in alive),
        "plans_in_flight": sum(w.plans_in_flight for w in alive),
        "instances": len(instances), "load": sum(i.running + i.waiting for i in instances if i.alive),
    }
    return {"time": now, "totals": totals, "workers": [_worker(w) for w in workers],
            "instances": [_instance(i) for i in instances], "shards": _shards(num_shards, leases, now),
            "artifacts": _artifacts(keys, artifacts_total)}


def page() -> bytes:
    """The dashboard page (it polls ``api/state`` relative to its own address)."""
    return resources.files("tensorcast.obs").joinpath("dashboard.html").read_bytes()


@functools.cache
def page_csp() -> str:
    """The page's Content-Security-Policy: its own inline script and style (by hash, so nothing injected runs),
    requests to its own origin only, no framing, no forms, no plugins."""
    html = page().decode()

    def hashes(tag: str) -> str:
        bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", html, re.S)
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'"
                        for b in bodies)

    return (f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; "
            "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
