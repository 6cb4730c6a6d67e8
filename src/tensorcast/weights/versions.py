"""Weight versions by name: keys, use records, which versions garbage collection keeps, polling delays (pure).

Owns: the key scheme of published weight versions (``{model}@v{N}``) and of the records bindings keep on the
versions they use (``{model}@use/v{N}/{holder}``, caller-leased), the small tag tensor that makes every version
its own artifact (and the reserved names of such tensors), choosing the next version number, the
garbage-collection decision (the newest ``keep_last`` versions, plus every version some binding uses, are
kept), and the bounded backoff of waits for a newer version. Does not own: storing, listing or deleting
anything (``client.publisher``, ``client.binding``).

Why a tag tensor: artifacts are content-addressed, so two versions with equal tensors (or two models with
the same state dict) would be one artifact with several keys. Deleting one key would still keep the other
(keys are independent references), but whatever names a version by id (use records, views, a delete by id)
would name both. The tag (``{model}@v{N}`` as bytes, a few dozen bytes) makes each version's artifact id its
own.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorcast.errors import InvalidArgument, clip

__all__ = ["DELTA_TENSOR", "META_TENSORS", "VERSION_TENSOR", "Backoff", "check_holder", "check_model",
           "gc_decision", "next_version", "parse_use_key", "parse_version_key", "use_key", "use_prefix", "use_tag",
           "version_key", "version_prefix", "version_tag", "versions_in_use"]

# The tag tensor every published version carries, and the delta record a version published after another by
# the same publisher may carry (``weights.delta``). Neither is a weight: bindings and loaders skip them.
VERSION_TENSOR = "__tensorcast_version__"
DELTA_TENSOR = "__tensorcast_delta__"
META_TENSORS = frozenset({VERSION_TENSOR, DELTA_TENSOR})
_DIGITS = re.compile(r"[0-9]{1,18}")


def check_model(model: Any) -> str:
    """A model name: non-empty, printable, without ``@`` (which separates it from the version)."""
    if not isinstance(model, str) or not model or "@" in model or any(ord(c) < 32 for c in model) \
            or len(model) > 512:
        raise InvalidArgument(f"model name must be 1..512 printable characters without '@', got {clip(model)}")
    return model


def check_holder(holder: Any) -> str:
    """A binding's holder name (part of a key): non-empty, printable, without ``/`` or ``@``."""
    if not isinstance(holder, str) or not holder or any(c in holder for c in "/@") \
            or any(ord(c) < 32 for c in holder) or len(holder) > 200:
        raise InvalidArgument(f"holder must be 1..200 printable characters without '/' or '@', got {clip(holder)}")
    return holder


def check_version(version: Any, what: str = "version") -> int:
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version < 10**18:
        raise InvalidArgument(f"{what} must be an integer >= 1, got {clip(version)}")
    return version


def version_prefix(model: str) -> str:
    return f"{model}@v"


def version_key(model: str, version: int) -> str:
    return f"{model}@v{check_version(version)}"


def parse_version_key(model: str, key: str) -> int | None:
    """N for ``{model}@vN``; None for any other key."""
    prefix = version_prefix(model)
    if not key.startswith(prefix) or not _DIGITS.fullmatch(key[len(prefix):]):
        return None
    n = int(key[len(prefix):])
    return n if n >= 1 and key == version_key(model, n) else None  # "v01" is not version 1's key


def use_prefix(model: str) -> str:
    return f"{model}@use/"


def use_key(model: str, version: int, holder: str) -> str:
    return f"{use_prefix(model)}v{check_version(version)}/{check_holder(holder)}"


def parse_use_key(model: str, key: str) -> tuple[int, str] | None:
    """(version, holder) for ``{model}@use/vN/holder``; None for any other key."""
    prefix = use_prefix(model)
    if not key.startswith(prefix + "v"):
        return None
    number, _, holder = key[len(prefix) + 1:].partition("/")
    if not _DIGITS.fullmatch(number) or not holder or "/" in holder:
        return None
    return int(number), holder


def version_tag(model: str, version: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The tag tensor of version ``version`` of ``model`` (see the module docstring)."""
    return np.frombuffer(version_key(model, version).encode(), dtype=np.uint8).copy()


def use_tag(model: str, version: int, holder: str) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The content of a use record: distinct per (model, version, holder), so each is its own lease."""
    return np.frombuffer(use_key(model, version, holder).encode(), dtype=np.uint8).copy()


def next_version(existing: Iterable[int]) -> int:
    return max(existing, default=0) + 1


def versions_in_use(model: str, use_keys: Iterable[str]) -> dict[int, tuple[str, ...]]:
    """``{version: holders}`` from the keys of live use records."""
    out: dict[int, list[str]] = {}
    for key in use_keys:
        parsed = parse_use_key(model, key)
        if parsed is not None:
            out.setdefault(parsed[0], []).append(parsed[1])
    return {v: tuple(sorted(h)) for v, h in sorted(out.items())}


def gc_decision(versions: Iterable[int], in_use: Mapping[int, Any] | Iterable[int], keep_last: int) -> list[int]:
    """The versions to delete: all but the newest ``keep_last`` and those in use, oldest first."""
    if keep_last < 1:
        raise InvalidArgument(f"keep_last must be >= 1, got {keep_last}")
    ordered = sorted(set(versions))
    keep = set(ordered[-keep_last:]) | set(in_use)
    return [v for v in ordered if v not in keep]


@dataclass(frozen=True)
class Backoff:
    """Delays between polls: ``initial`` doubling up to ``maximum``, never past the deadline."""

    initial: float = 0.05
    maximum: float = 1.0

    def delay(self, attempt: int, now: float, deadline: float | None) -> float:
        d = float(min(self.initial * 2.0 ** min(attempt, 30), self.maximum))
        return d if deadline is None else max(0.0, min(d, deadline - now))
