"""Views (slices and tensor-parallel shards) are byte-exact against numpy slicing, locally and remotely."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tensorcast as tc
from tensorcast.cluster import LocalCluster
from tensorcast.errors import InvalidArgument
from tensorcast.tensors import DTYPES
from tensorcast.views import TP, TPRules, chunk_range

DTYPE_NAMES = ["float32", "bfloat16", "int8", "float16", "float64", "bool", "float8_e4m3fn"]


@pytest.fixture(scope="module")
def readers(shared_cluster: LocalCluster) -> Iterator[tuple[tc.Client, tc.Client]]:
    local = tc.connect(shared_cluster.address)
    remote = tc.connect(shared_cluster.address, config=tc.Config.from_flat({"client.host_id": "far-away"}))
    yield local, remote
    local.close()
    remote.close()


@st.composite
def tensor_and_slices(draw: st.DrawFn) -> tuple[np.ndarray, list[tuple[int, slice]]]:
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(0, 9)) for _ in range(ndim))
    dtype = DTYPES[draw(st.sampled_from(DTYPE_NAMES))]
    n = int(np.prod(shape)) * dtype.itemsize
    raw = np.frombuffer(draw(st.binary(min_size=n, max_size=n)), dtype=np.uint8) if n else np.empty(0, np.uint8)
    arr = raw.view(dtype).reshape(shape)
    dims = draw(st.lists(st.integers(0, ndim - 1), unique=True, max_size=ndim))
    slices = []
    for d in dims:
        a = draw(st.integers(-12, 12))
        b = draw(st.integers(-12, 12))
        step = draw(st.integers(1, 3))
        slices.append((d, slice(a, b, step)))
    return arr, slices


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=tensor_and_slices())
def test_slices_match_numpy(readers: tuple[tc.Client, tc.Client], case: tuple[np.ndarray, list]) -> None:
    arr, slices = case
    local, remote = readers
    art = local.put({"t": arr})
    index = [slice(None)] * arr.ndim
    for d, s in slices:
        index[d] = s
    want = arr[tuple(index)]
    for reader in (local, remote):
        got = reader.artifact(art.id).view(slices={"t": slices}).tensor("t", like="numpy")
        assert got.shape == want.shape and got.dtype == want.dtype
        assert got.tobytes() == np.ascontiguousarray(want).tobytes()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_tp_views_match_torch_chunk_and_reassemble(readers: tuple[tc.Client, tc.Client], world: int) -> None:
    local, remote = readers
    g = torch.Generator().manual_seed(world)
    sd = {
        "q_proj.weight": torch.randn(10, 6, generator=g).to(torch.bfloat16),  # column-parallel, uneven
        "o_proj.weight": torch.randn(6, 10, generator=g),  # row-parallel
        "norm.weight": torch.randn(6, generator=g),  # replicated
    }
    rules = {"*q_proj*": 0, "*o_proj*": 1, "*norm*": "replicated"}
    art = local.put(sd)
    for reader in (local, remote):
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in sd}
        for rank in range(world):
            shard = reader.artifact(art.id).view(tp=tc.TP(rank, world), rules=rules).tensor_dict()
            for k, v in shard.items():
                parts[k].append(v)
            q_chunks = torch.chunk(sd["q_proj.weight"], world, dim=0)
            want_q = q_chunks[rank] if rank < len(q_chunks) else sd["q_proj.weight"][:0]
            assert torch.equal(shard["q_proj.weight"], want_q)
            assert torch.equal(shard["norm.weight"], sd["norm.weight"])
        assert torch.equal(torch.cat(parts["q_proj.weight"], 0), sd["q_proj.weight"])
        assert torch.equal(torch.cat(parts["o_proj.weight"], 1), sd["o_proj.weight"])


def test_view_into_and_errors(client: tc.Client) -> None:
    w = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    art = client.put({"w": w})
    view = art.view(tp=tc.TP(1, 2), rules={"w": 1})
    assert view.shape("w") == (4, 3)
    target = torch.zeros(4, 3)
    view.tensor_dict_into({"w": target})
    assert torch.equal(target, w[:, 3:])
    with pytest.raises(InvalidArgument):
        view.tensor_dict_into({"w": torch.zeros(4, 6)})
    with pytest.raises(InvalidArgument, match="no tensor-parallel rule"):
        art.view(tp=tc.TP(0, 2), rules={"other": 0})
    with pytest.raises(InvalidArgument):
        art.view(slices={"w": [(5, slice(0, 1))]})
    with pytest.raises(InvalidArgument):
        tc.TP(2, 2)
    with pytest.raises(InvalidArgument):
        art.view()


def test_rule_matching_and_chunking() -> None:
    rules = TPRules([("re:.*\\.(q|k|v)_proj\\.weight", 0), ("*.down_proj.*", 1), ("*", "replicated")])
    assert rules.spec_for("layers.0.k_proj.weight") == 0
    assert rules.spec_for("layers.0.down_proj.weight") == 1
    assert rules.spec_for("lm_head.weight") == "replicated"
    assert [chunk_range(5, TP(r, 4)) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert [chunk_range(0, TP(r, 2)) for r in range(2)] == [(0, 0), (0, 0)]
