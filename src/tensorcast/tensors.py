"""Tensor identity and conversion: dtypes, per-tensor metadata, content digests, artifact ids.

Owns: the table of supported dtypes (names shared by numpy, ml_dtypes and torch), turning caller inputs
(numpy arrays, torch CPU tensors, mappings of them) into contiguous byte views plus ``TensorMeta`` (digests
on demand: a same-host put hashes while it copies), the canonical artifact id, and wrapping raw bytes back
into numpy arrays or torch tensors without copying. Does not own: where bytes live (``pool``), how they
travel (``wire``).

Identity: a tensor's digest is BLAKE3 of its bytes (row-major, little-endian); an artifact's id is BLAKE3
of its sorted ``(name, dtype, shape, digest)`` list. Equal content gives equal ids on every host, which is
what lets the pool store identical tensors once.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import blake3
import ml_dtypes
import msgspec
import numpy as np

from tensorcast.errors import InvalidArgument, ResourceExhausted, clip
from tensorcast.records import TensorMeta

__all__ = [
    "ARTIFACT_ID_RE",
    "DTYPES",
    "TensorInput",
    "artifact_id",
    "copy_bytes_hint",
    "digest_bytes",
    "dtype_name",
    "import_torch",
    "normalize_tensors",
    "numpy_dtype",
    "raw_dtype",
    "wrap_bytes",
]

# name -> numpy dtype; torch dtypes are resolved lazily so torch stays optional.
DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(dt)
    for name, dt in {
        "bool": np.bool_,
        "uint8": np.uint8,
        "int8": np.int8,
        "uint16": np.uint16,
        "int16": np.int16,
        "uint32": np.uint32,
        "int32": np.int32,
        "uint64": np.uint64,
        "int64": np.int64,
        "float16": np.float16,
        "float32": np.float32,
        "float64": np.float64,
        "complex64": np.complex64,
        "complex128": np.complex128,
        "bfloat16": ml_dtypes.bfloat16,
        "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
        "float8_e5m2": ml_dtypes.float8_e5m2,
        "float8_e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
        "float8_e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
        "float8_e8m0fnu": ml_dtypes.float8_e8m0fnu,
    }.items()
}
_NAME_BY_NUMPY = {dt: name for name, dt in DTYPES.items()}

ARTIFACT_ID_RE = re.compile(r"^tc-[0-9a-f]{32}$")
# Above this many bytes BLAKE3 hashes with all cores.
_MULTITHREAD_HASH_BYTES = 8 * 1024**2
_ENCODER = msgspec.msgpack.Encoder()


def numpy_dtype(name: str) -> np.dtype[Any]:
    try:
        return DTYPES[name]
    except KeyError:
        raise InvalidArgument(f"unsupported dtype {clip(name)}; supported: {', '.join(DTYPES)}") from None


_RAW: dict[int, np.dtype[Any]] = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32),
                                  8: np.dtype(np.uint64)}


def raw_dtype(name: str) -> np.dtype[Any]:
    """An unsigned integer dtype as wide as ``name``'s: slicing and copying bytes through it takes numpy's
    memcpy paths (a custom dtype such as bfloat16 copies element by element, about 1.5x slower)."""
    size = numpy_dtype(name).itemsize
    return _RAW.get(size, np.dtype(f"V{size}"))


def dtype_name(dtype: Any) -> str:
    """TensorCast's name of a numpy or torch dtype (``InvalidArgument`` if unsupported)."""
    if isinstance(dtype, np.dtype) or (isinstance(dtype, type) and issubclass(dtype, np.generic)):
        name = _NAME_BY_NUMPY.get(np.dtype(dtype))
    else:
        name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise InvalidArgument(f"unsupported dtype {clip(dtype)}; supported: {', '.join(DTYPES)}")
    return name


def digest_bytes(data: memoryview | bytes | np.ndarray[Any, Any]) -> str:
    """BLAKE3 hex digest of a contiguous buffer."""
    view = data if isinstance(data, bytes) else memoryview(data).cast("B")  # type: ignore[arg-type]
    threads = blake3.blake3.AUTO if len(view) >= _MULTITHREAD_HASH_BYTES else 1
    return str(blake3.blake3(view, max_threads=threads).hexdigest())


def artifact_id(metas: list[TensorMeta] | tuple[TensorMeta, ...]) -> str:
    canon = sorted((m.name, m.dtype, list(m.shape), m.digest) for m in metas)
    return "tc-" + str(blake3.blake3(_ENCODER.encode(canon)).hexdigest())[:32]


class TensorInput:
    """One caller tensor ready to store: a contiguous uint8 view of its bytes plus its metadata.

    The digest (BLAKE3 of the bytes: the one pass over them that costs as much as copying them) is computed
    when ``meta`` is first asked for, unless a writer that hashed the bytes itself, while copying them,
    set ``digest`` first."""

    __slots__ = ("data", "digest", "dtype", "name", "shape")

    def __init__(self, name: str, dtype: str, shape: tuple[int, ...], data: np.ndarray[Any, np.dtype[np.uint8]],
                 digest: str = "") -> None:
        self.name = name
        self.dtype = dtype
        self.shape = shape
        self.data = data
        self.digest = digest

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def meta(self) -> TensorMeta:
        """Its metadata, digest included (hashing the bytes now if nobody has)."""
        if not self.digest:
            self.digest = digest_bytes(self.data)
        return self.meta_without_digest(self.digest)

    def meta_without_digest(self, digest: str = "") -> TensorMeta:
        return TensorMeta(name=self.name, dtype=self.dtype, shape=self.shape, nbytes=self.nbytes, digest=digest)


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 62


def _check_copy(name: str, nbytes: int, strides: tuple[int, ...]) -> None:
    """A view that must be copied to be stored (not contiguous) may claim far more bytes than back it: a
    stride-0 array of one byte can claim 4 TiB. Refuse what could never fit this host's memory, instead of an
    untyped ``MemoryError`` (or an overflow) from deep inside numpy or torch."""
    if nbytes > _host_memory():
        raise InvalidArgument(f"tensor {clip(name)}: a non-contiguous view (strides {strides}) claiming {nbytes} "
                              "bytes, more than this host's memory; store the tensor it views instead")


def _contiguous(name: str, arr: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    if not arr.flags.c_contiguous:
        _check_copy(name, int(arr.size) * arr.dtype.itemsize, tuple(arr.strides))
    try:
        return np.ascontiguousarray(arr)
    except MemoryError:
        raise ResourceExhausted(f"tensor {clip(name)}: no memory to copy its {arr.nbytes} bytes contiguous") from None


def _torch_to_numpy(t: Any, label: str = "tensor") -> np.ndarray[Any, Any]:
    import torch

    if t.device.type != "cpu":
        raise InvalidArgument(f"only CPU tensors can be put directly, got device {t.device}")
    if t.layout != torch.strided:
        raise InvalidArgument(f"{t.layout} tensors are not supported: convert with .to_dense() first")
    if t.is_quantized:
        raise InvalidArgument("quantized tensors are not supported: store .int_repr() and the scales instead")
    name = str(t.dtype).removeprefix("torch.")
    np_dtype = numpy_dtype(name)
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():  # numel * element_size in Python ints: torch's own product overflows int64
        _check_copy(label, int(t.numel()) * int(t.element_size()), tuple(t.stride()))
    try:
        flat = t.contiguous().reshape(-1)
    except (MemoryError, RuntimeError) as exc:  # torch reports allocation failures as RuntimeError
        raise ResourceExhausted(f"tensor {clip(label)}: could not copy it contiguous: {clip(str(exc))}") from None
    if flat.numel() == 0:
        return np.empty(tuple(t.shape), dtype=np_dtype)
    raw: np.ndarray[Any, Any] = flat.view(torch.uint8).numpy()
    return raw.view(np_dtype).reshape(tuple(t.shape))


def _is_torch(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "dtype") and hasattr(obj, "device")


def _as_numpy(name: str, value: Any) -> np.ndarray[Any, Any]:
    if _is_torch(value):
        return _torch_to_numpy(value, name)
    if isinstance(value, np.ndarray | np.generic):
        arr = np.asarray(value)
        if arr.dtype.byteorder == ">":
            _check_copy(name, int(arr.size) * arr.dtype.itemsize, tuple(arr.strides))
            arr = arr.astype(arr.dtype.newbyteorder("="))
        return arr
    raise InvalidArgument(
        f"tensor {clip(name)}: expected a numpy array or a torch CPU tensor, got {type(value).__name__}"
    )


def normalize_tensors(tensors: Any) -> list[TensorInput]:
    """Caller input -> list of ``TensorInput`` sorted by name (digests computed when first asked for)."""
    if isinstance(tensors, Mapping):
        items = list(tensors.items())
        if not items:
            raise InvalidArgument("an artifact needs at least one tensor")
    else:
        items = [("tensor", tensors)]
    out: list[TensorInput] = []
    for name, value in items:
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"tensor names must be non-empty strings, got {clip(name)}")
        try:
            name.encode()
        except UnicodeEncodeError:
            raise InvalidArgument(f"tensor name {clip(name)}: not valid UTF-8 (a lone surrogate)") from None
        arr = _as_numpy(name, value)
        dtype_name = _NAME_BY_NUMPY.get(arr.dtype)
        if dtype_name is None:
            raise InvalidArgument(f"tensor {clip(name)}: unsupported dtype {arr.dtype}")
        raw = _contiguous(name, arr).reshape(-1).view(np.uint8)
        out.append(TensorInput(name, dtype_name, tuple(int(s) for s in arr.shape), raw))
    out.sort(key=lambda t: t.name)
    return out


def copy_bytes_hint(tensors: Any) -> int | None:
    """Bytes that normalizing a caller input would copy (0 for contiguous arrays and tensors in native byte
    order, which it only views), when telling costs nothing (numpy arrays and torch tensors, or a mapping of
    them); None otherwise. Lets a caller normalize where it is, instead of on a thread, when that is quick."""
    values = list(tensors.values()) if isinstance(tensors, Mapping) else [tensors]
    total = 0
    for v in values:
        if isinstance(v, np.ndarray):
            total += 0 if v.flags.c_contiguous and v.dtype.byteorder != ">" else v.nbytes
        elif hasattr(v, "element_size") and hasattr(v, "numel") and hasattr(v, "is_contiguous"):
            # a torch tensor, without importing torch; conjugate and negative views are resolved by a copy
            lazy = getattr(v, "is_conj", lambda: False)() or getattr(v, "is_neg", lambda: False)()
            total += 0 if v.is_contiguous() and not lazy else int(v.numel()) * int(v.element_size())
        else:
            return None
    return total


def import_torch() -> Any:
    """torch, or ``InvalidArgument`` saying how to do without it (it is optional)."""
    try:
        import torch
    except ImportError:
        raise InvalidArgument("like='torch' needs PyTorch, which is not installed (pip install torch); "
                              "ask for like='numpy' instead") from None
    return torch


def wrap_bytes(buf: Any, meta: TensorMeta, like: str) -> Any:
    """View ``buf`` (a buffer of at least ``meta.nbytes`` bytes) as a numpy array or torch tensor, no copy."""
    np_dtype = numpy_dtype(meta.dtype)
    count = meta.nbytes // np_dtype.itemsize if np_dtype.itemsize else 0
    if like == "numpy":
        if meta.nbytes == 0:
            return np.empty(meta.shape, dtype=np_dtype)
        return np.frombuffer(buf, dtype=np_dtype, count=count).reshape(meta.shape)
    if like == "torch":
        torch = import_torch()
        tdtype = getattr(torch, meta.dtype)
        if meta.nbytes == 0:
            return torch.empty(meta.shape, dtype=tdtype)
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=meta.nbytes)
        return raw.view(tdtype).reshape(meta.shape)
    raise InvalidArgument(f"like must be 'torch' or 'numpy', got {clip(like)}")
