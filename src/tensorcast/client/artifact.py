"""What the sync and async artifact handles share: the record, its read-only accessors, and views.

Owns: ``ArtifactBase`` (id, the key the handle stands for, tensor names, per-tensor metadata, size,
replicas and copies), ``Deletion`` (what a delete did), the shape/dtype check for filling caller tensors,
copying into them, which slices a view takes of an artifact (explicit slices, or a tensor-parallel rank by
rules or by the checkpoint's ``model_type``), and the options of a prefetch (``PrefetchOptions``, declared once
for every prefetch entry point) with the request they make. Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import numpy as np

from tensorcast.errors import InvalidArgument, NotFound
from tensorcast.limits import check_ttl
from tensorcast.records import ArtifactInfo, ReplicaInfo, SliceSpec, TensorMeta
from tensorcast.tensors import numpy_dtype
from tensorcast.views import TP, TPRules, normalize_slices
from tensorcast.weights.rules import rules_for
from tensorcast.wire.messages import Prefetch

__all__ = ["ArtifactBase", "Deletion", "PrefetchOptions", "build_view_slices", "check_target", "copy_into", "like_of",
           "prefetch_request", "wants_view"]


class Deletion(str):
    """What ``delete`` returns: the artifact id (a ``str``, as before), and whether the content went.

    ``removed``: no reference keeps the artifact any more, so its record and bytes are gone (always so for a
    delete by id). Otherwise ``keys`` are the keys still naming it."""

    removed: bool
    keys: tuple[str, ...]

    def __new__(cls, artifact_id: str, removed: bool = True, keys: tuple[str, ...] = ()) -> Deletion:
        out = super().__new__(cls, artifact_id)
        out.removed, out.keys = removed, keys
        return out


class ArtifactBase:
    def __init__(self, info: ArtifactInfo, own_key: str | None = None) -> None:
        self.info = info
        # The key this handle was put, looked up or listed under (None: put without a key, or found by id):
        # the reference that ``renew`` and ``release`` act on.
        self.own_key = own_key

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def key(self) -> str | None:
        """The key this handle was put, looked up or listed under; for a handle without one (found by id, or
        put without a key), the first key naming the artifact, or None. ``keys`` lists them all."""
        if self.own_key is not None:
            return self.own_key
        return self.info.keys[0] if self.info.keys else None

    @property
    def keys(self) -> tuple[str, ...]:
        return self.info.keys

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.info.tensors)

    @property
    def nbytes(self) -> int:
        return self.info.nbytes

    @property
    def replicas(self) -> tuple[ReplicaInfo, ...]:
        return self.info.replicas

    @property
    def copies(self) -> int:
        """Distinct live workers holding a copy (any tier), as of this handle's record (``refresh()`` reads it
        again)."""
        return self.info.copies

    @property
    def replicas_wanted(self) -> int:
        """Copies its placement wants on distinct live workers (``ha``: 2). A put returns with ``copies`` below
        it only when fewer live workers could take one before its deadline; the workers make the missing ones
        as soon as they can, as they do after a worker's loss (``tensorcast_replicas_missing``)."""
        return self.info.replicas_wanted

    @property
    def owner(self) -> str:
        """"system" when any reference keeps the artifact permanently (a key bound, or a put made, without a
        ttl), else "lease" (``lease_expiry``: when the last lease ends)."""
        return self.info.owner

    @property
    def lease_expiry(self) -> float | None:
        return self.info.lease_expiry

    def meta(self, name: str | None = None) -> TensorMeta:
        name = self._single_name(name)
        for t in self.info.tensors:
            if t.name == name:
                return t
        raise NotFound(f"artifact {self.id} has no tensor {name!r} (has {list(self.tensor_names)})")

    def _single_name(self, name: str | None) -> str:
        if name is not None:
            return name
        if len(self.info.tensors) != 1:
            raise InvalidArgument(f"artifact {self.id} holds {len(self.info.tensors)} tensors: name one of "
                                  f"{list(self.tensor_names)}")
        return self.info.tensors[0].name

    def __repr__(self) -> str:
        key = f" key={self.key!r}" if self.key else ""
        return f"<{type(self).__name__} {self.id}{key} tensors={len(self.info.tensors)} nbytes={self.nbytes}>"


def check_target(meta: TensorMeta, target: Any) -> None:
    """A caller tensor can receive ``meta``'s bytes in place: same shape and dtype, writable."""
    shape = tuple(int(s) for s in target.shape)
    if shape != tuple(meta.shape):
        raise InvalidArgument(f"tensor {meta.name!r}: target shape {shape} != stored shape {tuple(meta.shape)}")
    if isinstance(target, np.ndarray):
        if target.dtype != numpy_dtype(meta.dtype):
            raise InvalidArgument(f"tensor {meta.name!r}: target dtype {target.dtype} != stored {meta.dtype}")
        if not target.flags.writeable:
            raise InvalidArgument(f"tensor {meta.name!r}: target array is read-only")
    else:
        dtype = str(getattr(target, "dtype", "")).removeprefix("torch.")
        if dtype != meta.dtype:
            raise InvalidArgument(f"tensor {meta.name!r}: target dtype {dtype} != stored {meta.dtype}")


def like_of(targets: Mapping[str, Any]) -> str:
    """"torch" if any target is a torch tensor, else "numpy"."""
    return "torch" if any(type(t).__module__.startswith("torch") for t in targets.values()) else "numpy"


def copy_into(targets: Mapping[str, Any], sources: Mapping[str, Any]) -> None:
    for n, dst in targets.items():
        src = sources[n]
        if isinstance(dst, np.ndarray):
            np.copyto(dst, np.asarray(src))
        else:
            dst.copy_(src)


def build_view_slices(info: ArtifactInfo, slices: Mapping[str, Sequence[tuple[int, slice]]] | None,
                      tp: TP | None, rules: TPRules | Mapping[str, Any] | None) -> dict[str, tuple[SliceSpec, ...]]:
    """The slices a view takes of each tensor: ``slices`` as given, or rank ``tp``'s by ``rules`` (by default
    the rule set of the artifact's ``model_type``)."""
    metas = {t.name: t for t in info.tensors}
    if (slices is None) == (tp is None):
        raise InvalidArgument("a view takes either slices=... or tp=TP(rank, world_size)")
    if slices is not None:
        out = {}
        for name, spec in slices.items():
            if name not in metas:
                raise NotFound(f"artifact {info.id} has no tensor {name!r}")
            out[name] = normalize_slices(metas[name].shape, spec)
        return out
    assert tp is not None
    if rules is None:
        model_type = info.meta.get("model_type", "")
        if not model_type:
            raise InvalidArgument("a tensor-parallel view needs rules (tensor name pattern -> split dim or "
                                  "'replicated'); this artifact has no model_type to choose them by")
        config = json.loads(info.meta.get("config", "{}"))
        rule_set = rules_for(model_type, config)
    else:
        rule_set = rules if isinstance(rules, TPRules) else TPRules(rules)
    return {t.name: rule_set.slices(t.name, t.shape, tp) for t in info.tensors}


class PrefetchOptions(TypedDict, total=False):
    """The options of every prefetch (``AsyncArtifact.prefetch``, ``AsyncClient.prefetch``, their sync twins,
    ``client.ops.prefetch``, ``tensorcast.prefetch``), declared once; each entry point takes them as
    ``**options``. An option left out has the default in brackets.

    - ``pin`` (False): keep the copy resident, for ``pin_ttl`` seconds (None: until unpinned).
    - ``timeout`` (None: ``client.timeout``): seconds the whole prefetch may take.
    - ``streams`` (0: the worker's default): parallel TCP streams of the worker-to-worker copy.
    - ``tp`` with ``rules``, or ``slices`` (None): materialize only that view on the worker (the warm path for
      one tensor-parallel rank's weights; ``rules`` default to the checkpoint's ``model_type``).
    - ``device`` (""): also keep a copy on that GPU of the worker (``"cuda:N"``), which same-host callers open
      with CUDA IPC; a worker without CUDA refuses it.
    """

    pin: bool
    pin_ttl: float | None
    timeout: float | None
    streams: int
    tp: TP | None
    rules: TPRules | Mapping[str, Any] | None
    slices: Mapping[str, Sequence[tuple[int, slice]]] | None
    device: str


def prefetch_request(artifact_id: str, to: str, options: PrefetchOptions) -> Prefetch:
    """The request of a prefetch of the whole artifact (a view is added by the handle that cuts it), after
    checking the options: an unknown one, or a bad ``pin_ttl``, is ``InvalidArgument``."""
    unknown = sorted(set(options) - PrefetchOptions.__optional_keys__)
    if unknown:
        raise InvalidArgument(f"prefetch has no option {', '.join(map(repr, unknown))}; it takes "
                              f"{', '.join(sorted(PrefetchOptions.__optional_keys__))}")
    pin_ttl = options.get("pin_ttl")
    if pin_ttl is not None:
        check_ttl(pin_ttl, "pin_ttl")
    return Prefetch(artifact_id=artifact_id, worker_id=to, pin=options.get("pin", False), pin_ttl=pin_ttl,
                    streams=options.get("streams", 0), device=options.get("device", ""))


def wants_view(options: PrefetchOptions) -> bool:
    """Whether a prefetch asks for a view (``tp``, ``slices`` or ``rules``) rather than the whole artifact."""
    return any(options.get(k) is not None for k in ("tp", "slices", "rules"))
