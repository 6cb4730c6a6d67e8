"""Pin the public surface: a change here is a change users see."""

from __future__ import annotations

import tensorcast
import tensorcast.aio
from tensorcast import errors


def test_exports() -> None:
    assert sorted(tensorcast.__all__) == sorted([
        "PRESETS", "TP", "Artifact", "ArtifactInfo", "Binding", "CallContext", "Client", "Config", "Diagnostics",
        "InstanceInfo", "LocalCluster", "Operation", "Placement", "Plan", "PlanOutcome", "PlanStep", "ReplicaInfo",
        "TPRules", "TensorMeta", "View", "WeightPublisher", "WorkerInfo", "__version__", "artifact", "connect",
        "context", "delete", "errors", "get_client", "init", "list_instances", "list_workers", "ls", "plan",
        "prefetch", "put",
    ])
    for name in tensorcast.__all__:
        assert hasattr(tensorcast, name), name
    assert sorted(tensorcast.aio.__all__) == ["AsyncArtifact", "AsyncClient", "AsyncView", "connect"]


def test_engine_facing_exports() -> None:
    """Engines import these by name: SGLang's bundled TensorCast backend (``tensorcast.api.store``) and the
    KV plumbing its and our connectors use."""
    import tensorcast.api.store
    import tensorcast.kv

    assert set(tensorcast.api.store.__all__) >= {
        "AllocatorTransferOptions", "ByteArtifactKeyspace", "ByteArtifactSpec", "HostMemorySpan",
        "RegionArtifactExistsResult", "RegionArtifactInputError", "RegionArtifactTransfer",
        "RegionArtifactTransferResult", "RegionBackedArtifactSession", "RegionBackedArtifactSessionOptions",
        "RegionSessionFailedError", "RegionSessionFailure", "RegionSessionFailureCode", "RegionSessionOperationKind",
        "RegionSessionTerminatedError", "ScratchTransferOptions"}
    for name in tensorcast.api.store.__all__:
        assert hasattr(tensorcast.api.store, name), name
    assert sorted(tensorcast.kv.__all__) == ["BlockRegions", "KVLayout", "page_keys", "shard_of", "shards_of"]


def test_error_tree_and_codes() -> None:
    leaves = [errors.NotFound, errors.AlreadyExists, errors.InvalidArgument, errors.DeadlineExceeded,
              errors.Unauthenticated, errors.PermissionDenied, errors.ResourceExhausted, errors.Unavailable,
              errors.ChunkCorrupted, errors.StaleFencingToken, errors.VersionConflict, errors.SwapAborted,
              errors.InternalError]
    assert len({c.code for c in leaves}) == len(leaves)
    for cls in leaves:
        assert issubclass(cls, errors.TensorCastError)
        rebuilt = errors.error_from_code(cls.code, "m", "t")
        assert type(rebuilt) is cls and rebuilt.trace_id == "t" and rebuilt.message == "m"
    assert errors.Unavailable.retryable and not errors.NotFound.retryable and not errors.AlreadyExists.retryable
    assert issubclass(errors.ChunkCorrupted, errors.Unavailable) and errors.ChunkCorrupted.retryable
    assert isinstance(errors.error_from_code("WHAT", "x"), errors.InternalError)
