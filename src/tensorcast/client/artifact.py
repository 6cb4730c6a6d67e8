"""What the sync and async artifact handles share: the record and its read-only accessors.

Owns: ``ArtifactBase`` (id, key, tensor names, per-tensor metadata, size, replicas) and the shape/dtype
check for filling caller tensors. Does not own: any I/O.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tensorcast.errors import InvalidArgument, NotFound
from tensorcast.tensors import numpy_dtype
from tensorcast.wire.messages import ArtifactInfo, ReplicaInfo, TensorMeta

__all__ = ["ArtifactBase", "check_target"]


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
