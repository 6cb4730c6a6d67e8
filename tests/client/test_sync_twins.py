"""The synchronous facade mirrors the asyncio client: every public async method has a sync twin with the
same parameters (names, kinds, defaults, annotations); only the return type differs (an ``Operation`` for
calls that start background work, the sync handle for handles)."""

from __future__ import annotations

import inspect

import pytest

import tensorcast as tc
from tensorcast.client.aio import AsyncArtifact, AsyncClient, AsyncView
from tensorcast.client.kv import AsyncKV
from tensorcast.client.sync import KV, Artifact, Client, Operations, View

# Async methods with no sync twin, and why.
NO_TWIN = {
    (AsyncKV, "aclose"): "the sync client closes its KV client with itself",
    (AsyncKV, "close"): "the sync client closes its KV client with itself",
    (AsyncKV, "refresh"): "lease-table refreshes are internal to the KV client's retries",
    (AsyncArtifact, "kept_tensors"): "already synchronous: the sync Artifact's tensor() and tensor_dict() call it on "
                                     "the caller's thread before they hop to the client's loop",
}
PAIRS = [(AsyncClient, Client), (AsyncArtifact, Artifact), (AsyncView, View), (AsyncKV, KV)]


def _public_methods(cls: type) -> list[str]:
    return sorted(n for n, v in inspect.getmembers(cls) if not n.startswith("_") and inspect.isfunction(v))


def _params(fn: object) -> list[tuple[str, object, object, object]]:
    sig = inspect.signature(fn, eval_str=True)  # type: ignore[arg-type]
    return [(p.name, p.kind, p.default, p.annotation) for p in sig.parameters.values()]


@pytest.mark.parametrize(("aio", "sync"), PAIRS, ids=[a.__name__ for a, _ in PAIRS])
def test_every_async_method_has_a_sync_twin_with_the_same_parameters(aio: type, sync: type) -> None:
    problems = []
    for name in _public_methods(aio):
        if (aio, name) in NO_TWIN:
            continue
        twin = getattr(sync, name, None)
        if twin is None or not callable(twin):
            problems.append(f"{sync.__name__}.{name} is missing")
        elif _params(twin) != _params(getattr(aio, name)):
            problems.append(f"{sync.__name__}.{name}{inspect.signature(twin)} != "
                            f"{aio.__name__}.{name}{inspect.signature(getattr(aio, name))}")
    assert not problems, "\n".join(problems)


def test_one_prefetch_with_every_parameter() -> None:
    """Every prefetch entry point (client, artifact, operations, module level) takes the same options."""
    want = [p for p in _params(AsyncArtifact.prefetch) if p[0] not in ("self", "to")]
    for fn in (AsyncClient.prefetch, Client.prefetch, Operations.prefetch, tc.prefetch):
        got = [p for p in _params(fn) if p[0] not in ("self", "to", "key_or_id")]
        assert got == want, fn.__qualname__

