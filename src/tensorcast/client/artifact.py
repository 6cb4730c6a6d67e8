"""What the sync and async artifact handles share: the record, its read-only accessors, and views.

Owns: ``ArtifactBase`` (id, key, tensor names, per-tensor metadata, size, replicas), the shape/dtype
check for filling caller tensors, copying into them, and which slices a view takes of an artifact
(explicit slices, or a tensor-parallel rank by rules or by the checkpoint's ``model_type``). Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tensorcast.errors import InvalidArgument, NotFound
from tensorcast.records import ArtifactInfo, ReplicaInfo, SliceSpec, TensorMeta
from tensorcast.tensors import numpy_dtype
from tensorcast.views import TP, TPRules, normalize_slices
from tensorcast.weights.rules import rules_for

__all__ = ["ArtifactBase", "build_view_slices", "check_target", "copy_into", "like_of"]


class ArtifactBase:
    def __init__(self, info: ArtifactInfo) -> None:
        self.info = info

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def key(self) -> str | None:
        """The first key pointing at this artifact (see ``keys`` for all)."""
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
    def owner(self) -> str:
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
