"""What ``tensorcast status`` prints: the cluster's workers, instances, shard leases and artifacts, once, as
JSON, or live in the terminal (``--watch``).

Owns: fetching the signals through a client (``cluster_state``: the same view the dashboard serves,
``obs.dashboard.cluster_view``, plus every process's metrics URL) and rendering them as tables. Does not own:
the view itself, the flags (``cli.commands``), or the dashboard page.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from rich.console import Group
from rich.markup import escape
from rich.table import Table

from tensorcast.cli.files import size
from tensorcast.obs.dashboard import cluster_view

if TYPE_CHECKING:
    from tensorcast.client.sync import Client

__all__ = ["cluster_state", "instance_table", "memory_cell", "shard_table", "shown", "view_tables", "worker_table"]

# Keys grouped by prefix in the live view (the dashboard's limit too; `tensorcast ls` lists them all).
VIEW_KEYS = 10_000


def shown(text: object) -> str:
    """Text a peer chose (worker and instance ids, hosts, keys) as it may reach a terminal: control and other
    unprintable characters written as escapes (``\\x1b``: an id must not clear the screen, retitle the window or
    hide a row), and rich markup escaped (``[red]`` is shown, not applied)."""
    value = str(text)
    if not value.isprintable():
        value = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in value)
    return escape(value)


def cluster_state(client: Client) -> dict[str, Any]:
    """The dashboard's view of the cluster, from the signals any client reads, with every metrics URL."""
    workers, instances, shards = client.list_workers(), client.list_instances(), client.list_shards()
    artifacts = client.ls(limit=VIEW_KEYS)
    keys = [(k, a.nbytes) for a in artifacts for k in a.info.keys]
    total = len(artifacts) if len(artifacts) < VIEW_KEYS else -1  # -1: more than the view counts
    view = cluster_view(workers, instances, shards.num_shards, shards.leases, keys, total, shards.now)
    # Copies that placements want on distinct live workers and do not have (the workers are making them).
    view["replicas_missing"] = sum(max(a.replicas_wanted - a.copies, 0) for a in artifacts)
    urls = client.metrics_urls()
    view["metrics_urls"] = urls
    view["dashboard_url"] = urls["gs"] + "/" if "gs" in urls else ""
    return view


def view_tables(view: dict[str, Any]) -> Group:
    """The view as terminal tables (``--watch`` redraws them)."""
    t = view["totals"]
    head = Table.grid(padding=(0, 3))
    head.add_row(f"workers {t['workers_alive']}/{t['workers']}",
                 f"memory {size(t['memory_used'])} / {size(t['memory_capacity'])}",
                 f"net in {size(t['net_in_bps'])}/s out {size(t['net_out_bps'])}/s",
                 f"transfers {t['transfers_in_flight']}", f"plans {t['plans_in_flight']}",
                 f"instance load {t['load']}", f"replicas missing {view.get('replicas_missing', 0)}",
                 f"dashboard {shown(view.get('dashboard_url') or '-')}")
    workers = Table(title="workers")
    for col in ("id", "host", "memory", "pre-faulted", "net in/out", "transfers", "plans", "artifacts", "alive"):
        workers.add_column(col)
    for w in view["workers"]:
        workers.add_row(shown(w["id"]), shown(w["host"]), f"{size(w['memory_used'])} / {size(w['memory_capacity'])} "
                        f"({100 * w['memory_pressure']:.0f}%)", size(w["memory_prefaulted"]),
                        f"{size(w['net_in_bps'])}/s / {size(w['net_out_bps'])}/s", str(w["transfers_in_flight"]),
                        str(w["plans_in_flight"]), str(w["artifacts"]), "yes" if w["alive"] else "[red]no[/red]")
    parts: list[Any] = [head, workers]
    if view["instances"]:
        instances = Table(title="instances")
        for col in ("id", "engine", "home worker", "running", "waiting", "KV tokens", "alive"):
            instances.add_column(col)
        for i in view["instances"]:
            instances.add_row(shown(i["id"]), shown(i["engine"]), shown(i["home_worker"]), str(i["running"]),
                              str(i["waiting"]),
                              f"{i['kv_tokens_used']} / {i['kv_tokens_capacity']}", "yes" if i["alive"] else "no")
        parts.append(instances)
    s = view["shards"]
    shards = Table(title=f"KV shards ({s['num_shards']}, {s['vacant']} vacant)")
    for col in ("holder", "shards", "max fencing token"):
        shards.add_column(col)
    for h in s["by_holder"]:
        shards.add_row(shown(h["holder"]), str(h["shards"]), str(h["max_token"]))
    arts = view["artifacts"]
    artifacts = Table(title=f"artifacts by key prefix ({arts['total'] if arts['total'] >= 0 else 'many'})")
    for col in ("prefix", "keys", "bytes"):
        artifacts.add_column(col)
    for g in arts["by_prefix"][:20]:
        artifacts.add_row(shown(g["prefix"]), str(g["keys"]), size(g["bytes"]))
    return Group(*parts, shards, artifacts)


def shard_table(client: Client, show_shards: bool) -> Table:
    shards = client.list_shards()
    stable = Table(title=f"KV shards ({shards.num_shards})")
    if show_shards:
        for col in ("shard", "holder", "fencing token", "lease age", "expires in"):
            stable.add_column(col)
        for lease in shards.leases:
            live = lease.holder and lease.expiry > shards.now
            stable.add_row(str(lease.shard), shown(lease.holder or "-"), str(lease.token),
                           f"{shards.now - lease.acquired_at:.1f}s" if live else "-",
                           f"{lease.expiry - shards.now:.1f}s" if live else "[red]expired[/red]")
        return stable
    for col in ("holder", "shards", "oldest lease", "max fencing token"):
        stable.add_column(col)
    by_holder: dict[str, list[Any]] = {}
    for lease in shards.leases:
        live = lease.holder and lease.expiry > shards.now
        by_holder.setdefault(lease.holder if live else "(none)", []).append(lease)
    unleased = shards.num_shards - len(shards.leases)
    if unleased:
        by_holder.setdefault("(none)", [])
    for holder, leases in sorted(by_holder.items()):
        count = len(leases) + (unleased if holder == "(none)" else 0)
        age = max((shards.now - lease.acquired_at for lease in leases), default=0.0)
        token = max((lease.token for lease in leases), default=0)
        stable.add_row(shown(holder), str(count), f"{age:.1f}s" if holder != "(none)" else "-", str(token))
    return stable


def memory_cell(used: int, prefaulted: int, capacity: int) -> str:
    """``1.0 GiB used (512.0 MiB pre-faulted) / 4.0 GiB``: the pre-faulted stock is memory the worker holds
    beyond what its tensors use (``worker.prefault_bytes``), so it is shown, not hidden behind ``0 B``."""
    stock = f" ({size(prefaulted)} pre-faulted)" if prefaulted else ""
    return f"{size(used)} used{stock} / {size(capacity)}"


def worker_table(client: Client) -> Table:
    table = Table(title="workers")
    for col in ("id", "pid", "address", "host", "roles", "memory", "disk", "net in/out", "artifacts", "alive",
                "last heartbeat"):
        table.add_column(col)
    now = time.time()
    for w in client.list_workers():
        table.add_row(shown(w.worker_id), str(w.pid), shown(w.address), shown(w.host_id), shown(",".join(w.roles)),
                      memory_cell(w.memory_used, w.memory_prefaulted, w.memory_capacity),
                      f"{size(w.disk_used)} / {size(w.disk_capacity)}" if w.disk_capacity else "-",
                      f"{size(w.net_in_bps)}/s / {size(w.net_out_bps)}/s", str(w.artifacts),
                      "yes" if w.alive else "[red]no[/red]", f"{now - w.last_heartbeat:.1f}s ago")
    return table


def instance_table(client: Client) -> Table | None:
    instances = client.list_instances()
    if not instances:
        return None
    table = Table(title="instances")
    for col in ("id", "engine", "home worker", "running", "waiting", "KV tokens", "alive"):
        table.add_column(col)
    for i in instances:
        table.add_row(shown(i.instance_id), shown(i.engine), shown(i.home_worker), str(i.running), str(i.waiting),
                      f"{i.kv_tokens_used} / {i.kv_tokens_capacity}", "yes" if i.alive else "[red]no[/red]")
    return table
