"""What the global store shows operators: the dashboard's routes and the metrics only it knows.

Owns: ``/`` (the dashboard page), ``/api/state`` (``obs.dashboard.cluster_view`` of the store's records) and
``/healthz`` (ready while its backend serves) on the global store's HTTP endpoint, and the samples it reports
at each scrape (workers alive, artifacts, copies missing, shard leases held and vacant). Does not own: the
records (``gs.service``), the page or the view (``obs.dashboard``), or serving HTTP (``obs.http``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Protocol

from tensorcast import clock
from tensorcast.config import Config
from tensorcast.errors import TensorCastError
from tensorcast.gs.backend import MetadataBackend
from tensorcast.gs.goals import under_replicated
from tensorcast.obs.dashboard import cluster_view, page, page_csp
from tensorcast.obs.http import Response, Route
from tensorcast.obs.metrics import Sample
from tensorcast.records import ArtifactInfo, InstanceInfo, WorkerInfo
from tensorcast.wire.kv_messages import ShardTable


class GlobalStore(Protocol):
    """What is shown of the global store service (``gs.service.GlobalStore``)."""

    config: Config
    backend: MetadataBackend

    async def workers(self) -> list[WorkerInfo]: ...

    async def instances(self) -> list[InstanceInfo]: ...

    async def shard_table(self) -> ShardTable: ...

    async def info(self, artifact_id: str, workers: dict[str, WorkerInfo] | None = None) -> ArtifactInfo: ...

__all__ = ["GSGauges", "cluster_state", "gs_routes"]

# The dashboard groups at most this many keys by prefix (a view, not an inventory: `tensorcast ls` pages).
DASHBOARD_KEYS = 100_000


async def cluster_state(gs: GlobalStore) -> dict[str, Any]:
    workers = await gs.workers()
    instances = await gs.instances()
    table = await gs.shard_table()
    keys, total = await gs.backend.key_sizes(DASHBOARD_KEYS)
    return cluster_view(workers, instances, table.num_shards, table.leases, keys, total, clock.time())


def gs_routes(gs: GlobalStore) -> dict[str, Route]:
    refresh = gs.config.metrics.dashboard_refresh

    async def index(query: str) -> Response:
        return Response(page(), "text/html; charset=utf-8", csp=page_csp())

    async def state(query: str) -> Response:
        view = await cluster_state(gs)
        view["refresh"] = refresh
        return Response(json.dumps(view).encode(), "application/json")

    async def health(query: str) -> Response:
        """Ready only while the metadata backend serves: on etcd, while a member with a leader answers."""
        try:
            await gs.backend.check()
        except TensorCastError as exc:
            return Response(f"unavailable: {exc.message}\n".encode(), status=503)
        return Response(b"ok\n")

    return {"/": index, "/api/state": state, "/healthz": health}


class GSGauges:
    """The global store's own gauges, read from its records just before each scrape (``refresh``) and
    reported by ``samples`` (which Prometheus' collector calls synchronously)."""

    def __init__(self, gs: GlobalStore) -> None:
        self.gs = gs
        self.values: dict[str, float] = {}

    async def refresh(self) -> None:
        workers = await self.gs.workers()
        table = await self.gs.shard_table()
        _keys, artifacts = await self.gs.backend.key_sizes(0)
        _short, missing = await under_replicated(self.gs, "", 0)
        self.values = {"workers_alive": sum(w.alive for w in workers), "workers": len(workers),
                       "artifacts": artifacts, "replicas_missing": missing,
                       "leases_held": sum(1 for s in table.leases if s.holder and s.expiry > table.now),
                       "num_shards": table.num_shards}

    def samples(self) -> Iterator[Sample]:
        for name, help_text, key in (
            ("tensorcast_gs_workers", "Workers the global store knows.", "workers"),
            ("tensorcast_gs_workers_alive", "Workers heartbeating within the liveness timeout.", "workers_alive"),
            ("tensorcast_gs_artifacts", "Artifacts the global store records.", "artifacts"),
            ("tensorcast_gs_shard_leases_held", "KV shards under an unexpired lease.", "leases_held"),
            ("tensorcast_gs_shards", "KV shards in the cluster (gs.kv_num_shards).", "num_shards"),
            ("tensorcast_replicas_missing", "Copies that artifacts' placements want on distinct live workers and "
             "do not have (replicas=2 with one live holder: 1).", "replicas_missing"),
        ):
            yield Sample(name, help_text, {}, self.values.get(key, 0))
