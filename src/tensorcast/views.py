"""Views: slices of an artifact's tensors, and tensor-parallel sharding rules (pure).

Owns: normalizing ``[(dim, slice), ...]`` into ``SliceSpec``s, the shape and (when contiguous) the byte
range they select, applying them to an array, and ``TP``/``TPRules``: which slice of each tensor one
tensor-parallel rank gets. Uneven splits follow ``torch.chunk``: every rank gets ``ceil(n / world)``
elements along the split dimension except the last ones, which get the remainder, possibly nothing.
Does not own: where the slicing runs (on the worker that holds the replica, ``worker.reads``).

Rules map tensor-name patterns to a spec: an int (split that dimension), ``"replicated"``, or a callable
``(name, shape, tp) -> [(dim, slice), ...]`` for layouts such as fused qkv. Patterns are fnmatch globs,
or regular expressions when prefixed with ``re:``; the first matching rule wins.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import blake3
import msgspec
import numpy as np

from tensorcast.errors import InvalidArgument
from tensorcast.records import SliceSpec

__all__ = ["TP", "Fused", "RuleSpec", "TPRules", "apply_slices", "byte_range", "check_slices", "chunk_range",
           "normalize_slices", "sliced_shape", "view_artifact_id"]

_ENCODER = msgspec.msgpack.Encoder()
SliceFn = Callable[[str, tuple[int, ...], "TP"], Sequence[tuple[int, slice]]]
RuleSpec = Union[int, str, SliceFn, "Fused"]


@dataclass(frozen=True, slots=True)
class TP:
    """One tensor-parallel rank: ``rank`` of ``world_size``."""

    rank: int
    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise InvalidArgument(f"TP needs 0 <= rank < world_size, got rank={self.rank} "
                                  f"world_size={self.world_size}")


def chunk_range(n: int, tp: TP) -> tuple[int, int]:
    """``torch.chunk(x, world_size)[rank]`` along a dimension of size ``n`` (empty past the last chunk)."""
    per = -(-n // tp.world_size) if n else 0
    start = min(tp.rank * per, n)
    return start, min(start + per, n)


def normalize_slices(shape: tuple[int, ...], slices: Sequence[tuple[int, slice]]) -> tuple[SliceSpec, ...]:
    out: dict[int, SliceSpec] = {}
    for item in slices:
        try:
            dim, sl = item
        except (TypeError, ValueError):
            raise InvalidArgument(f"a slice is (dim, slice), got {item!r}") from None
        if not isinstance(dim, int) or not -len(shape) <= dim < len(shape):
            raise InvalidArgument(f"dimension {dim!r} out of range for shape {shape}")
        dim %= len(shape)
        if dim in out:
            raise InvalidArgument(f"dimension {dim} sliced twice")
        if not isinstance(sl, slice):
            raise InvalidArgument(f"expected a slice for dimension {dim}, got {sl!r}")
        if sl.step is not None and (not isinstance(sl.step, int) or sl.step < 1):
            raise InvalidArgument(f"slice step {sl.step!r}: only positive slice steps are supported")
        try:
            start, stop, step = sl.indices(shape[dim])
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"slice {sl!r} of dimension {dim}: {exc}") from None
        out[dim] = SliceSpec(dim=dim, start=start, stop=max(start, stop), step=step)
    return tuple(out[d] for d in sorted(out))


def check_slices(shape: tuple[int, ...], specs: Sequence[SliceSpec]) -> None:
    """``InvalidArgument`` unless every spec names a dimension of ``shape`` once, with a positive step and
    bounds inside it (specs that arrive from a peer are checked before anything is cut)."""
    seen: set[int] = set()
    for s in specs:
        if not 0 <= s.dim < len(shape) or s.dim in seen:
            raise InvalidArgument(f"slice of dimension {s.dim}: out of range for shape {shape}, or sliced twice")
        seen.add(s.dim)
        n = shape[s.dim]
        if s.step < 1 or not 0 <= s.start <= s.stop <= n:
            raise InvalidArgument(f"slice {s.start}:{s.stop}:{s.step} of dimension {s.dim} (size {n}): steps "
                                  "must be positive, bounds within the dimension")
        if any(not 0 <= a < b <= n for a, b in s.ranges):
            raise InvalidArgument(f"ranges {list(s.ranges)[:4]} of dimension {s.dim} (size {n}) out of bounds")


def sliced_shape(shape: tuple[int, ...], specs: Sequence[SliceSpec]) -> tuple[int, ...]:
    check_slices(shape, specs)
    dims = list(shape)
    for s in specs:
        dims[s.dim] = sum(b - a for a, b in s.ranges) if s.ranges else len(range(s.start, s.stop, s.step))
    return tuple(dims)


def byte_range(shape: tuple[int, ...], itemsize: int, specs: Sequence[SliceSpec]) -> tuple[int, int] | None:
    """The byte range the slices select if it is one contiguous run of a row-major tensor, else None."""
    full = [s for s in specs if s.ranges or not (s.start == 0 and s.stop == shape[s.dim] and s.step == 1)]
    if not full:
        return 0, int(np.prod(shape, dtype=np.int64)) * itemsize
    if len(full) > 1 or full[0].step != 1 or len(full[0].ranges) > 1:
        return None
    if full[0].ranges:
        full = [SliceSpec(dim=full[0].dim, start=full[0].ranges[0][0], stop=full[0].ranges[0][1])]
    dim = full[0].dim
    if any(shape[d] != 1 for d in range(dim)):
        return None
    inner = int(np.prod(shape[dim + 1 :], dtype=np.int64)) * itemsize
    return full[0].start * inner, full[0].stop * inner


def apply_slices(arr: np.ndarray[Any, Any], specs: Sequence[SliceSpec]) -> np.ndarray[Any, Any]:
    check_slices(arr.shape, specs)
    index: list[slice] = [slice(None)] * arr.ndim
    multi: list[SliceSpec] = []
    for s in specs:
        if s.ranges:
            multi.append(s)
        else:
            index[s.dim] = slice(s.start, s.stop, s.step)
    out = arr[tuple(index)]
    for s in multi:
        parts = []
        for a, b in s.ranges:
            sel: list[slice] = [slice(None)] * arr.ndim
            sel[s.dim] = slice(a, b)
            parts.append(out[tuple(sel)])
        out = np.concatenate(parts, axis=s.dim)
    return out


@dataclass(frozen=True, slots=True)
class Fused:
    """A rule spec for a tensor that stacks parts along ``dim`` (fused qkv: sizes (q, k, v); fused gate_up:
    parts=2): each rank gets its ``torch.chunk`` share of every part, concatenated in part order."""

    dim: int = 0
    parts: int = 0
    sizes: tuple[int, ...] = ()

    def ranges(self, name: str, n: int, tp: TP) -> tuple[tuple[int, int], ...]:
        sizes = self.sizes or ((n // self.parts,) * self.parts if self.parts and n % self.parts == 0 else ())
        if not sizes or sum(sizes) != n:
            raise InvalidArgument(f"{name}: dimension {self.dim} of size {n} does not split into "
                                  f"{self.sizes or self.parts}")
        out = []
        base = 0
        for size in sizes:
            lo, hi = chunk_range(size, tp)
            out.append((base + lo, base + hi))
            base += size
        return tuple(out)


def view_artifact_id(parent_id: str, slices: Mapping[str, Sequence[SliceSpec]]) -> str:
    """The id of the artifact that materializes these slices of ``parent_id`` (same slices, same id)."""
    doc = [parent_id, sorted((name, [list(msgspec.structs.astuple(s)) for s in specs]) for name, specs
                             in slices.items())]
    return "tc-" + str(blake3.blake3(_ENCODER.encode(doc)).hexdigest())[:32]


def _matcher(pattern: str) -> Callable[[str], bool]:
    if pattern.startswith("re:"):
        rx = re.compile(pattern[3:])
        return lambda name: rx.fullmatch(name) is not None
    return lambda name: fnmatch.fnmatchcase(name, pattern)


class TPRules:
    """Ordered ``pattern -> spec`` rules; ``default`` applies when no pattern matches (None: error)."""

    def __init__(self, rules: Mapping[str, RuleSpec] | Sequence[tuple[str, RuleSpec]] = (),
                 default: RuleSpec | None = None) -> None:
        items = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
        self.items: list[tuple[str, RuleSpec]] = list(items)
        self._rules: list[tuple[Callable[[str], bool], str, RuleSpec]] = []
        for pattern, spec in items:
            self._check_spec(pattern, spec)
            self._rules.append((_matcher(pattern), pattern, spec))
        if default is not None:
            self._check_spec("<default>", default)
        self.default = default

    @staticmethod
    def _check_spec(pattern: str, spec: RuleSpec) -> None:
        if isinstance(spec, Fused):
            return
        if not ((isinstance(spec, int) and not isinstance(spec, bool)) or spec == "replicated" or callable(spec)):
            raise InvalidArgument(f"rule {pattern!r}: spec must be a dimension, 'replicated' or a callable, "
                                  f"got {spec!r}")

    def spec_for(self, name: str) -> RuleSpec:
        for match, _, spec in self._rules:
            if match(name):
                return spec
        if self.default is None:
            raise InvalidArgument(f"no tensor-parallel rule matches tensor {name!r}")
        return self.default

    def slices(self, name: str, shape: tuple[int, ...], tp: TP) -> tuple[SliceSpec, ...]:
        spec = self.spec_for(name)
        if spec == "replicated":
            return ()
        if isinstance(spec, Fused):
            if not -len(shape) <= spec.dim < len(shape):
                raise InvalidArgument(f"rule for {name!r} fuses dimension {spec.dim}, but its shape is {shape}")
            dim = spec.dim % len(shape)
            return (SliceSpec(dim=dim, start=0, stop=shape[dim], ranges=spec.ranges(name, shape[dim], tp)),)
        if callable(spec):
            return normalize_slices(shape, spec(name, shape, tp))
        assert isinstance(spec, int)
        if not shape:
            raise InvalidArgument(f"tensor {name!r} is 0-d: it can only be replicated")
        if not -len(shape) <= spec < len(shape):
            raise InvalidArgument(f"rule for {name!r} splits dimension {spec}, but its shape is {shape}")
        dim = spec % len(shape)
        lo, hi = chunk_range(shape[dim], tp)
        return (SliceSpec(dim=dim, start=lo, stop=hi),)
