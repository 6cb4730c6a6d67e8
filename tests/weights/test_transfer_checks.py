"""The rollout side of the ``tensorcast`` vLLM weight-transfer backend refuses a version that is not the
loaded model's before touching the model (``integrations.rollout_checks``); no vLLM needed."""

from __future__ import annotations

import numpy as np
import pytest

from tensorcast.errors import InvalidArgument
from tensorcast.integrations.rollout_checks import check_compatible, check_digests, layout_of

LOADED = {"w": ("float32", (4, 4)), "b": ("float32", (4,))}


@pytest.mark.parametrize(("staged", "message"), [
    ({"w": ("float32", (4, 4)), "b": ("float32", (4,))}, None),
    ({"w": ("float32", (4, 4))}, "missing \\['b'\\]"),
    ({**LOADED, "extra": ("float32", (1,))}, "unknown \\['extra'\\]"),
    ({"w": ("bfloat16", (4, 4)), "b": ("float32", (4,))}, "1 tensors changed dtype or shape, e.g. 'w'"),
    ({"w": ("float32", (8, 4)), "b": ("float32", (4,))}, "changed dtype or shape"),
    ({}, "holds no tensors"),
])
def test_a_staged_version_must_match_the_loaded_one(staged: dict[str, tuple[str, tuple[int, ...]]],
                                                     message: str | None) -> None:
    if message is None:
        check_compatible(LOADED, staged)
    else:
        with pytest.raises(InvalidArgument, match=message):
            check_compatible(LOADED, staged)


def test_the_first_version_is_taken_as_it_is() -> None:
    check_compatible(None, {"anything": ("int8", (1,))})
    assert layout_of({"w": np.zeros((2, 3), np.float16)}) == {"w": ("float16", (2, 3))}


def test_what_was_read_must_be_what_was_published() -> None:
    import torch

    from tensorcast.records import ArtifactInfo
    from tensorcast.tensors import normalize_tensors

    state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16), "b": np.ones(5, np.int8)}
    info = ArtifactInfo(id="x", tensors=tuple(t.meta for t in normalize_tensors(state)), nbytes=0)  # hashed
    check_digests(info, state, "policy v1")  # torch bfloat16 and numpy alike
    flipped = {**state, "b": np.array([1, 1, 2, 1, 1], np.int8)}
    with pytest.raises(InvalidArgument, match="tensor 'b' of policy v1 does not match"):
        check_digests(info, flipped, "policy v1")
