"""Reading a weight version as a rollout engine that holds the version before it: what changed only.

Owns ``delta_of`` (a version's delta record, ``weights.delta``, when it applies to an engine serving version
``active`` and agrees with that version's record: every tensor it leaves out has its old digest; None
otherwise: no record, another base, a malformed or inconsistent one, and the engine reads the whole version),
``read_changed`` (per changed tensor its changed runs of rows: mapped pool pages on the same host, no copy;
one ranged fetch per run from another host; every chunk checked against the record's XXH3-128, so that what
landed is what was published), and ``touched_layers`` (the tensors of every layer a delta touches, for an
engine that can only reload whole layers). Used by the vLLM weight-transfer backend
(``integrations.vllm_transfer``). Does not own: the record's format and chunking (``weights.delta``),
applying anything to a model.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import xxhash

from tensorcast.errors import InvalidArgument, clip
from tensorcast.integrations.rollout_checks import raw_bytes
from tensorcast.records import ArtifactInfo
from tensorcast.weights.delta import Delta, runs, with_rows
from tensorcast.weights.versions import DELTA_TENSOR, META_TENSORS

__all__ = ["ChangedRows", "delta_of", "layer_of", "read_changed", "touched_layers"]

log = logging.getLogger("tensorcast.rollout")


@dataclass(frozen=True)
class ChangedRows:
    """Rows ``first_row`` to ``first_row + len(rows)`` of tensor ``name`` (shape ``shape``) in the new version
    (a scalar: the whole of it)."""

    name: str
    shape: tuple[int, ...]
    first_row: int
    rows: Any  # a torch tensor of shape (rows, *shape[1:]), or the scalar


def delta_of(art: Any, active: int | None, base: ArtifactInfo | None) -> Delta | None:
    """``art``'s delta record (``art``: an ``Artifact`` handle of a version) if it is a delta from version
    ``active``, whose record is ``base``, and consistent with it: every tensor the record leaves out has the
    digest it had in ``base`` (a record that missed a change would otherwise leave old bytes serving). None
    otherwise, or when ``base`` is None (nothing served yet): the reader reads the whole version."""
    if active is None or base is None or DELTA_TENSOR not in art.tensor_names:
        return None
    layout = {t.name: (tuple(t.shape), t.nbytes) for t in art.info.tensors}
    try:
        delta = Delta.decode(art.tensor(DELTA_TENSOR, like="numpy"), layout)
    except InvalidArgument as exc:
        log.warning("ignoring the delta record of %s (reading the whole version): %s", art.id, exc)
        return None
    if delta.base != active:
        return None
    before = {t.name: t.digest for t in base.tensors if t.name not in META_TENSORS}
    now = {t.name: t.digest for t in art.info.tensors if t.name not in META_TENSORS}
    stale = sorted(n for n in now if n not in delta.tensors and before.get(n) != now[n])
    if stale or before.keys() != now.keys():
        log.warning("ignoring the delta record of %s (reading the whole version): it leaves out changed tensors, "
                    "e.g. %s", art.id, clip(stale[:1] or sorted(before.keys() ^ now.keys())[:1]))
        return None
    return delta


def read_changed(art: Any, delta: Delta, verify: bool = True) -> tuple[list[ChangedRows], int]:
    """The changed rows of ``art`` per ``delta`` and the bytes read. The k-th run of every tensor is read in
    the k-th view (a round trip each), so that a delta spread over many tensors costs few round trips."""
    metas = {t.name: t for t in art.info.tensors}
    plan = {name: (with_rows(tuple(metas[name].shape), metas[name].nbytes, per_chunk), dict(chunks))
            for name, (per_chunk, chunks) in delta.tensors.items()}
    spans = {name: runs(sorted(expected)) for name, (_, expected) in plan.items()}
    out: list[ChangedRows] = []
    moved = 0
    for k in range(max((len(r) for r in spans.values()), default=0)):
        slices = {}
        for name, rs in spans.items():
            if k < len(rs):
                r0, r1 = plan[name][0].rows_of(*rs[k])
                slices[name] = [(0, slice(r0, r1))] if metas[name].shape else []
        got = art.view(slices).tensor_dict(like="torch")
        for name in slices:
            cut, expected = plan[name]
            first, end = spans[name][k]
            data = raw_bytes(got[name])
            moved += int(data.nbytes)
            mv = data.data
            if verify:
                step = cut.per_chunk * cut.row_bytes
                for i in range(first, end):
                    if xxhash.xxh3_128_hexdigest(mv[(i - first) * step:(i - first + 1) * step]) != expected[i]:
                        raise InvalidArgument(f"chunk {i} of tensor {clip(name)} of {art.id} does not match its "
                                              "published checksum")
            out.append(ChangedRows(name, tuple(metas[name].shape), cut.rows_of(first, end)[0], got[name]))
    return out, moved


# Up to the first numeric component: a decoder layer ("model.layers.3"), whatever it holds (fused projections,
# every expert of a mixture): loaders fuse tensors within a layer, never across layers.
_LAYER = re.compile(r"^(.*?\.\d+)\.")


def layer_of(name: str) -> str:
    """The layer a checkpoint tensor belongs to: its decoder layer, else its module (``model.norm``)."""
    m = _LAYER.match(name)
    return m.group(1) if m else name.rpartition(".")[0] or name


def touched_layers(changed: Iterable[str], names: Iterable[str]) -> list[str]:
    """Every tensor of ``names`` in a layer one of ``changed`` belongs to, sorted."""
    layers = {layer_of(n) for n in changed}
    return sorted(n for n in names if layer_of(n) in layers)
