"""Reading safetensors checkpoints as Hugging Face lays them out, without reading tensor bytes.

Owns: parsing a file's header directly (8-byte little-endian length, JSON), the sharded layout
(``model.safetensors.index.json``), validating every entry (dtype known, shape and byte size agree,
offsets inside the file, no overlap) with errors that name the file and the tensor, and ``config.json``'s
``model_type``. Returns where each tensor's bytes are (file, absolute offset, size); reading them is
``weights.reader``'s job.
"""

from __future__ import annotations

import itertools
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tensorcast.errors import InvalidArgument, NotFound, clip

__all__ = ["Checkpoint", "CheckpointTensor", "open_checkpoint", "SAFETENSORS_DTYPES"]

SAFETENSORS_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "U32": "uint32",
    "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16", "BF16": "bfloat16", "F32": "float32",
    "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "C64": "complex64",
}
_ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "uint32": 4, "int32": 4, "uint64": 8,
             "int64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "float8_e4m3fn": 1,
             "float8_e5m2": 1, "complex64": 8}
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class CheckpointTensor:
    name: str
    dtype: str  # TensorCast dtype name
    shape: tuple[int, ...]
    file: str  # absolute path
    offset: int  # absolute byte offset of the data in the file
    nbytes: int
    file_size: int
    file_mtime_ns: int


@dataclass(frozen=True)
class Checkpoint:
    path: str
    tensors: dict[str, CheckpointTensor]
    config: dict[str, Any]

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", ""))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _parse_file(path: Path) -> list[CheckpointTensor]:
    try:
        st = path.stat()
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise InvalidArgument(f"{path}: truncated safetensors file (no header length)")
            (hlen,) = struct.unpack("<Q", raw)
            if hlen > _MAX_HEADER or 8 + hlen > st.st_size:
                raise InvalidArgument(f"{path}: header length {hlen} does not fit the {st.st_size}-byte file "
                                      "(truncated or not a safetensors file)")
            header_bytes = f.read(hlen)
    except FileNotFoundError:
        raise NotFound(f"checkpoint file {path} does not exist") from None
    except OSError as exc:
        raise InvalidArgument(f"{path}: cannot read: {exc}") from None
    try:
        header = json.loads(header_bytes)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{path}: corrupted safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise InvalidArgument(f"{path}: corrupted safetensors header (not an object)")
    data_start = 8 + hlen
    out: list[CheckpointTensor] = []
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            st_dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise InvalidArgument(f"{path}: tensor {clip(name)}: malformed header entry {clip(entry)}") from None
        dtype = SAFETENSORS_DTYPES.get(st_dtype)
        if dtype is None:
            raise InvalidArgument(f"{path}: tensor {clip(name)}: unsupported dtype {st_dtype}")
        if not all(isinstance(s, int) and s >= 0 for s in shape):
            raise InvalidArgument(f"{path}: tensor {clip(name)}: bad shape {shape}")
        numel = 1
        for s in shape:
            numel *= s
        if end - begin != numel * _ITEMSIZE[dtype] or begin < 0:
            raise InvalidArgument(f"{path}: tensor {clip(name)}: {end - begin} bytes do not match shape {shape} of "
                                  f"{st_dtype}")
        if data_start + end > st.st_size:
            raise InvalidArgument(f"{path}: tensor {clip(name)}: data ends at byte {data_start + end} but the file "
                                  f"has {st.st_size} bytes (truncated)")
        spans.append((begin, end, name))
        out.append(CheckpointTensor(name, dtype, tuple(shape), str(path.absolute()), data_start + begin,
                                    end - begin, st.st_size, st.st_mtime_ns))
    spans.sort()
    for (_b0, e0, n0), (b1, _e1, n1) in itertools.pairwise(spans):
        if b1 < e0:
            raise InvalidArgument(f"{path}: tensors {clip(n0)} and {clip(n1)} overlap")
    return out


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """A checkpoint directory (single ``*.safetensors`` or sharded with an index) or a single file."""
    p = Path(path)
    if not p.exists():
        raise NotFound(f"checkpoint {p} does not exist")
    files: list[Path]
    index_map: dict[str, str] | None = None
    if p.is_file():
        files = [p]
        root = p.parent
    else:
        root = p
        index = p / "model.safetensors.index.json"
        if index.exists():
            try:
                index_map = json.loads(index.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
                raise InvalidArgument(f"{index}: unreadable index: {exc}") from None
            assert index_map is not None
            files = [p / f for f in sorted(set(index_map.values()))]
        else:
            files = sorted(p.glob("*.safetensors"))
        if not files:
            raise NotFound(f"no safetensors files in {p}")
    tensors: dict[str, CheckpointTensor] = {}
    for f in files:
        for t in _parse_file(f):
            if t.name in tensors:
                raise InvalidArgument(f"tensor {clip(t.name)} appears in both {tensors[t.name].file} and {f}")
            if index_map is not None and index_map.get(t.name) != f.name:
                raise InvalidArgument(f"{f}: tensor {clip(t.name)} is not listed for this file in the index")
            tensors[t.name] = t
    if index_map is not None:
        missing = sorted(set(index_map) - set(tensors))
        if missing:
            raise InvalidArgument(f"index lists tensors missing from the files: {missing[:5]}")
    config: dict[str, Any] = {}
    cfg = root / "config.json"
    if cfg.exists():
        try:
            config = json.loads(cfg.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise InvalidArgument(f"{cfg}: unreadable config: {exc}") from None
    return Checkpoint(str(p.absolute()), tensors, config)
