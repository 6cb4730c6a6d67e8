"""The synchronous facade mirrors the asyncio client: every public async method has a sync twin with the
same parameters (names, kinds, defaults, annotations); only the return type differs (an ``Operation`` for
calls that start background work, the sync handle for handles). The module-level functions (``tc.put``) and
``client.ops`` take the parameters of the calls they stand for, and every prefetch takes one set of options."""

from __future__ import annotations

import inspect
from typing import Unpack

import pytest

import tensorcast as tc
from tensorcast.client.aio import AsyncArtifact, AsyncClient, AsyncView
from tensorcast.client.artifact import PrefetchOptions, prefetch_request, wants_view
from tensorcast.client.kv import AsyncKV
from tensorcast.client.sync import KV, Artifact, Client, Operations, View
from tensorcast.errors import InvalidArgument
from tensorcast.views import TP

# Async methods with no sync twin, and why.
NO_TWIN = {
    (AsyncKV, "aclose"): "the sync client closes its KV client with itself",
    (AsyncKV, "close"): "the sync client closes its KV client with itself",
    (AsyncKV, "refresh"): "lease-table refreshes are internal to the KV client's retries",
    (AsyncArtifact, "kept_tensors"): "already synchronous: the sync Artifact's tensor() and tensor_dict() call it on "
                                     "the caller's thread before they hop to the client's loop",
    (AsyncView, "kept_tensors"): "already synchronous: the sync View's tensor() and tensor_dict() call it first",
    (AsyncClient, "lookup_request"): "already synchronous: the sync lookup() sends it on the caller's thread",
    (AsyncClient, "looked_up"): "already synchronous: the sync lookup() makes its handle with it",
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
    """Every prefetch entry point (client, artifact, operations, module level) takes its options as one
    declared set, ``PrefetchOptions``, and nothing else beside what it prefetches and where."""
    options = [("options", inspect.Parameter.VAR_KEYWORD, inspect.Parameter.empty, Unpack[PrefetchOptions])]
    fns = (AsyncArtifact.prefetch, Artifact.prefetch, AsyncClient.prefetch, Client.prefetch, Operations.prefetch,
           tc.prefetch)
    for fn in fns:
        got = [p for p in _params(fn) if p[0] not in ("self", "to", "key_or_id")]
        assert got == options, fn.__qualname__
    assert sorted(PrefetchOptions.__optional_keys__) == ["device", "pin", "pin_ttl", "rules", "slices", "streams",
                                                         "timeout", "tp"]


def test_prefetch_options_make_one_request_and_refuse_unknown_ones() -> None:
    plain = prefetch_request("tc-1", "w0", {})
    assert (plain.pin, plain.pin_ttl, plain.streams, plain.device, plain.view) == (False, None, 0, "", None)
    full = prefetch_request("tc-1", "w1", {"pin": True, "pin_ttl": 5.0, "streams": 4, "device": "cuda:0",
                                           "timeout": 3.0})
    assert (full.worker_id, full.pin, full.pin_ttl, full.streams, full.device) == ("w1", True, 5.0, 4, "cuda:0")
    with pytest.raises(InvalidArgument, match="no option 'pinned'"):
        prefetch_request("tc-1", "w0", {"pinned": True})  # type: ignore[typeddict-unknown-key]
    with pytest.raises(InvalidArgument):
        prefetch_request("tc-1", "w0", {"pin_ttl": -1.0})
    assert not wants_view({"pin": True, "tp": None}) and wants_view({"tp": TP(0, 2)})


def _without(params: list[tuple[str, object, object, object]], *names: str) -> list[tuple[str, object, object, object]]:
    return [p for p in params if p[0] not in names]


def test_module_level_functions_take_the_parameters_of_their_client_method() -> None:
    """``tc.put``, ``tc.artifact``, ... stand for the default client's method of the same name."""
    functions = [n for n in tc.__all__
                 if inspect.isfunction(getattr(tc, n)) and getattr(tc, n).__module__ == "tensorcast"]
    assert {"put", "prefetch", "artifact", "ls", "delete", "list_workers", "list_instances", "plan"} <= set(functions)
    problems = []
    for name in functions:
        method = getattr(Client, name, None)
        if method is None:
            problems.append(f"tc.{name} has no Client.{name}")
        elif _params(getattr(tc, name)) != _without(_params(method), "self"):
            problems.append(f"tc.{name}{inspect.signature(getattr(tc, name))} != Client.{name}"
                            f"{inspect.signature(method)}")
    assert not problems, "\n".join(problems)


# Each ``client.ops`` method: the parameters it leads with, then the calls whose parameters follow, in order.
OPS = {
    "put": ((), (Client.put,)),
    "get": (("key_or_id",), (Artifact.tensor_dict,)),
    "view": (("key_or_id",), (Artifact.view, View.tensor_dict)),
    "prefetch": ((), (Client.prefetch,)),
    "pin": (("key_or_id",), (Artifact.pin,)),
    "unpin": (("key_or_id",), (Artifact.unpin,)),
    "release": (("key_or_id",), (Artifact.release,)),
    "delete": ((), (Client.delete,)),
    "kv_put": ((), (KV.put,)),
}
# ``client.ops`` methods that are shortcuts of one call with fewer parameters, and why.
OPS_SHORTCUTS = {
    "publish": "call_instance(instance, 'publish', request_id=...)",
    "hydrate": "call_instance(instance, 'hydrate', request_id=..., artifacts=...)",
    "transform_into": "call_instance(instance, 'transform_into', artifacts=...)",
}


def test_every_operation_takes_the_parameters_of_its_blocking_twin() -> None:
    assert set(_public_methods(Operations)) == set(OPS) | set(OPS_SHORTCUTS)
    problems = []
    for name, (lead, twins) in OPS.items():
        got = _without(_params(getattr(Operations, name)), "self")
        head = [p for p in got if p[0] in lead]
        assert [p[0] for p in head] == list(lead), name
        rest = got[len(lead):]
        want = [p for twin in twins for p in _without(_params(twin), "self")]
        if name == "view":  # one keyword-only parameter list: the view's, then the read's
            want = [(n, inspect.Parameter.KEYWORD_ONLY, d, a) for n, _kind, d, a in want]
        if rest != want:
            problems.append(f"Operations.{name}{inspect.signature(getattr(Operations, name))} != "
                            + " + ".join(f"{t.__qualname__}{inspect.signature(t)}" for t in twins))
    assert not problems, "\n".join(problems)

