"""TensorCast: a shared, programmable tensor pool for LLM infrastructure.

    import tensorcast as tc
    with tc.LocalCluster(workers=2) as cluster:
        client = tc.connect(cluster.address)
        art = client.put({"w": w}, key="demo/model@v1")
        w2 = client.artifact("demo/model@v1").tensor("w")
"""

from typing import Any, Unpack

from tensorcast import errors
from tensorcast.client.artifact import Deletion, PrefetchOptions
from tensorcast.client.operation import Operation
from tensorcast.client.reads import Diagnostics
from tensorcast.client.sync import Artifact, Client, View, connect, get_client, init
from tensorcast.client.weights_sync import Binding, WeightPublisher
from tensorcast.cluster import LocalCluster
from tensorcast.config import Config
from tensorcast.context import CallContext, context
from tensorcast.plans.builder import Plan, PlanOutcome, PlanStep
from tensorcast.pool.placement import PRESETS
from tensorcast.records import ArtifactInfo, InstanceInfo, Placement, ReplicaInfo, TensorMeta, WorkerInfo
from tensorcast.views import TP, TPRules
from tensorcast.wire.messages import Prefetched

__version__ = "0.1.0"

__all__ = [
    "Artifact",
    "ArtifactInfo",
    "Binding",
    "CallContext",
    "Client",
    "Config",
    "Diagnostics",
    "InstanceInfo",
    "LocalCluster",
    "Operation",
    "PRESETS",
    "Placement",
    "Plan",
    "PlanOutcome",
    "PlanStep",
    "ReplicaInfo",
    "TP",
    "TPRules",
    "TensorMeta",
    "View",
    "WeightPublisher",
    "WorkerInfo",
    "__version__",
    "artifact",
    "connect",
    "context",
    "delete",
    "errors",
    "get_client",
    "init",
    "list_instances",
    "list_workers",
    "ls",
    "plan",
    "prefetch",
    "put",
]


# Each function below is its ``Client`` method on the process-default client (see ``init``), with the same
# parameters (tests/client/test_sync_twins.py checks it).


def put(tensors: Any, key: str | None = None, *, ttl: float | None = None, policy: str | Placement | None = None,
        on: str | None = None, timeout: float | None = None, ctx: CallContext | None = None) -> Artifact:
    """``put`` on the process-default client (see ``init``)."""
    return get_client().put(tensors, key, ttl=ttl, policy=policy, on=on, timeout=timeout, ctx=ctx)


def prefetch(key_or_id: str, to: str, **options: Unpack[PrefetchOptions]) -> Operation[Prefetched]:
    """``prefetch`` on the process-default client (see ``Client.prefetch``; every option: ``PrefetchOptions``)."""
    return get_client().prefetch(key_or_id, to, **options)


def artifact(key_or_id: str, *, timeout: float | None = None) -> Artifact:
    return get_client().artifact(key_or_id, timeout=timeout)


def ls(prefix: str = "", *, limit: int | None = None) -> list[Artifact]:
    return get_client().ls(prefix, limit=limit)


def delete(key_or_id: str) -> Deletion:
    return get_client().delete(key_or_id)


def list_workers() -> list[WorkerInfo]:
    return get_client().list_workers()


def list_instances() -> list[InstanceInfo]:
    return get_client().list_instances()


def plan(ctx: CallContext | None = None) -> Plan:
    return get_client().plan(ctx)
