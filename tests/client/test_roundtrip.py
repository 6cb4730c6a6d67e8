"""Byte-exact round trips through real worker processes, same-host (shared memory) and remote (stream)."""

from __future__ import annotations

import mmap

import ml_dtypes
import numpy as np
import pytest
import torch

import tensorcast as tc
from tensorcast.errors import InvalidArgument, NotFound
from tensorcast.tensors import DTYPES

SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 0, 4), (4, 1, 3, 2), (1031,)]


def _random(dtype_name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    dt = DTYPES[dtype_name]
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""


@pytest.mark.parametrize("which", ["client", "remote_client"])
def test_every_dtype_and_odd_shape_roundtrips_byte_exact(which: str, request: pytest.FixtureRequest) -> None:
    client: tc.Client = request.getfixturevalue(which)
    rng = np.random.default_rng(0)
    tensors = {f"{d}/{i}": _random(d, s, rng) for d in DTYPES for i, s in enumerate(SHAPES)}
    art = client.put(tensors, key=f"test/dtypes/{which}")
    got = client.artifact(f"test/dtypes/{which}").tensor_dict(like="numpy")
    assert set(got) == set(tensors)
    for name, want in tensors.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert got[name].tobytes() == want.tobytes(), name
    client.delete(art.id)


def test_torch_tensors_all_dtypes_roundtrip(client: tc.Client, remote_client: tc.Client) -> None:
    torch_dtypes = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                    torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
                    torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64]
    g = torch.Generator().manual_seed(1)
    tensors = {}
    for dt in torch_dtypes:
        nbytes = 6 * 4 * torch.empty((), dtype=dt).element_size()
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        tensors[str(dt)] = raw.view(dt).reshape(6, 4)
    tensors["noncontig"] = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()
    tensors["scalar"] = torch.tensor(3.5)
    tensors["empty"] = torch.empty(0, 3)
    art = client.put(tensors)
    for reader in (client, remote_client):
        got = reader.artifact(art.id).tensor_dict()
        for name, want in tensors.items():
            assert got[name].dtype == want.dtype and got[name].shape == want.shape
            assert _bytes(got[name]) == _bytes(want), name
    client.delete(art.id)


def test_bfloat16_numpy_and_torch_agree(client: tc.Client) -> None:
    t = torch.randn(16, 8).to(torch.bfloat16)
    art = client.put(t)
    arr = art.tensor(like="numpy")
    assert arr.dtype == ml_dtypes.bfloat16
    assert np.array_equal(arr.view(np.uint16), t.view(torch.uint16).numpy())
    client.delete(art.id)


def test_same_host_read_is_a_private_mapping_and_writes_stay_private(client: tc.Client) -> None:
    x = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: above worker.small_object_bytes, so mapped
    art = client.put(x)
    a = art.tensor(like="numpy")
    base = a
    while getattr(base, "base", None) is not None:
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    assert isinstance(base, mmap.mmap), "same-host read must map the pool, not copy"
    a[:10] = -1.0
    b = client.artifact(art.id).tensor(like="numpy")
    assert np.array_equal(b, x), "a caller's write leaked into the stored artifact"
    t = art.tensor()  # torch
    t[0] = 42.0
    assert client.artifact(art.id).tensor(like="numpy")[0] == 0.0
    client.delete(art.id)


def test_tensor_dict_into_fills_in_place_and_checks(client: tc.Client) -> None:
    sd = {"w": torch.randn(8, 4), "b": torch.randn(4)}
    art = client.put(sd)
    targets = {"w": torch.zeros(8, 4), "b": torch.zeros(4)}
    ptr = targets["w"].data_ptr()
    art.tensor_dict_into(targets)
    assert targets["w"].data_ptr() == ptr
    assert torch.equal(targets["w"], sd["w"]) and torch.equal(targets["b"], sd["b"])
    np_target = {"w": np.zeros((8, 4), np.float32)}
    art.tensor_dict_into(np_target)
    assert np.array_equal(np_target["w"], sd["w"].numpy())
    with pytest.raises(InvalidArgument, match="shape"):
        art.tensor_dict_into({"w": torch.zeros(4, 8)})
    with pytest.raises(InvalidArgument, match="dtype"):
        art.tensor_dict_into({"w": torch.zeros(8, 4, dtype=torch.float64)})
    with pytest.raises(NotFound):
        art.tensor_dict_into({"nope": torch.zeros(1)})
    client.delete(art.id)


def test_bad_inputs_raise_typed_errors(client: tc.Client) -> None:
    with pytest.raises(InvalidArgument):
        client.put(np.array(["a", "b"]))
    with pytest.raises(InvalidArgument):
        client.put({})
    with pytest.raises(InvalidArgument):
        client.put([1, 2, 3])
    with pytest.raises(InvalidArgument):
        client.put(np.zeros(3), ttl=-1)
    with pytest.raises(InvalidArgument, match="look like artifact ids"):
        client.put(np.zeros(3), key="tc-" + "0" * 32)
    art = client.put({"a": np.zeros(2), "b": np.ones(2)})
    with pytest.raises(InvalidArgument, match="name one of"):
        art.tensor()
    with pytest.raises(NotFound):
        art.tensor("c")
    with pytest.raises(NotFound):
        client.artifact("no/such/key")
    with pytest.raises(NotFound):
        client.artifact("tc-" + "f" * 32)
    with pytest.raises(NotFound):
        client.delete("no/such/key")
    client.delete(art.id)
