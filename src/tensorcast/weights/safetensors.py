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
from tensorcast.weights.dcp_files import ITEMSIZE, METADATA_FILE, dcp_chunks, is_dcp_dir
from tensorcast.weights.files import CheckpointRoots, open_regular

__all__ = ["Checkpoint", "CheckpointTensor", "open_checkpoint", "SAFETENSORS_DTYPES"]

SAFETENSORS_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "U32": "uint32",
    "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16", "BF16": "bfloat16", "F32": "float32",
    "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "C64": "complex64",
}
MAX_HEADER = 100 * 1024 * 1024
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class CheckpointTensor:
    name: str
    dtype: str  # TensorCast dtype name
    shape: tuple[int, ...]
    file: str  # absolute path, or an s3:// URL
    offset: int  # absolute byte offset of the data in the file
    nbytes: int
    file_size: int
    file_mtime_ns: int
    etag: str = ""  # an object's ETag (s3:// files): reads are pinned to it


@dataclass(frozen=True)
class Checkpoint:
    path: str
    tensors: dict[str, CheckpointTensor]
    config: dict[str, Any]
    format: str = "safetensors"  # or "dcp": a Distributed Checkpoint directory (``weights.dcp_files``)

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", ""))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _read_exact(fd: int, n: int, at: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = os.pread(fd, n - len(out), at + len(out))
        if not got:
            break
        out += got
    return bytes(out)


def _read_json(path: Path, what: str, limit: int = MAX_HEADER) -> Any:
    """A small JSON file of the checkpoint (index, config), read from a regular file only."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise InvalidArgument(f"{path}: {what} of {size} bytes is larger than {limit}")
        return json.loads(_read_exact(fd, size, 0))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{path}: unreadable {what} ({exc.__class__.__name__})") from None
    finally:
        os.close(fd)


def _parse_file(path: Path) -> list[CheckpointTensor]:
    fd = open_regular(path)
    try:
        st = os.fstat(fd)
        raw = _read_exact(fd, 8, 0)
        if len(raw) < 8:
            raise InvalidArgument(f"{path}: truncated safetensors file (no header length)")
        hlen = header_length(raw, str(path), st.st_size)
        header_bytes = _read_exact(fd, hlen, 8)
    except OSError as exc:
        raise InvalidArgument(f"{path}: cannot read: {os.strerror(exc.errno or 0)}") from None
    finally:
        os.close(fd)
    return parse_header(header_bytes, str(path.absolute()), st.st_size, st.st_mtime_ns)


def header_length(first8: bytes, path: str, size: int) -> int:
    """The JSON header's length from a safetensors file's first 8 bytes, checked against the file's size."""
    (hlen,) = struct.unpack("<Q", first8[:8])
    if hlen > MAX_HEADER or 8 + hlen > size:
        raise InvalidArgument(f"{path}: not a safetensors file (its header length does not fit the "
                              f"{size}-byte file, or it is truncated)")
    return int(hlen)


def parse_header(header_bytes: bytes, path: str, size: int, mtime_ns: int, etag: str = "") -> list[CheckpointTensor]:
    """Every tensor a safetensors header lists, each entry validated against the file's ``size``."""
    hlen = len(header_bytes)
    try:
        header = json.loads(header_bytes)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{path}: corrupted safetensors header ({exc.__class__.__name__})") from None
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
            raise InvalidArgument(f"{path}: tensor {clip(name)}: malformed header entry") from None
        if not (isinstance(st_dtype, str) and isinstance(shape, list) and type(begin) is int and type(end) is int):
            raise InvalidArgument(f"{path}: tensor {clip(name)}: malformed header entry")
        dtype = SAFETENSORS_DTYPES.get(st_dtype)
        if dtype is None:
            raise InvalidArgument(f"{path}: tensor {clip(name)}: unsupported dtype {clip(st_dtype, 16)}")
        if not all(isinstance(s, int) and s >= 0 for s in shape):
            raise InvalidArgument(f"{path}: tensor {clip(name)}: bad shape")
        numel = 1
        for s in shape:
            numel *= s
        if end - begin != numel * ITEMSIZE[dtype] or begin < 0:
            raise InvalidArgument(f"{path}: tensor {clip(name)}: {end - begin} bytes do not match its shape of "
                                  f"{st_dtype}")
        if data_start + end > size:
            raise InvalidArgument(f"{path}: tensor {clip(name)}: data ends at byte {data_start + end} but the file "
                                  f"has {size} bytes (truncated)")
        spans.append((begin, end, name))
        out.append(CheckpointTensor(name, dtype, tuple(shape), path, data_start + begin, end - begin, size, mtime_ns,
                                    etag))
    spans.sort()
    for (_b0, e0, n0), (b1, _e1, n1) in itertools.pairwise(spans):
        if b1 < e0:
            raise InvalidArgument(f"{path}: tensors {clip(n0)} and {clip(n1)} overlap")
    return out


def open_checkpoint(path: str | os.PathLike[str], roots: CheckpointRoots | None = None) -> Checkpoint:
    """A checkpoint directory (single ``*.safetensors`` or sharded with an index) or a single file. With
    ``roots`` (a worker's), the checkpoint and every file it names (an index entry, a symlink: resolved)
    must lie under one of them (``PermissionDenied`` before a byte is read); files are read only if regular."""

    def allowed(f: Path) -> Path:
        return roots.check(f) if roots is not None else f

    p = allowed(Path(path))
    if not p.exists():
        raise NotFound(f"checkpoint {p} does not exist")
    if is_dcp_dir(p):
        return _open_dcp(p, roots)
    files: list[tuple[str, Path]]  # (the name the index lists, the file)
    index_map: dict[str, str] | None = None
    if p.is_file():
        files = [(p.name, p)]
        root = p.parent
    else:
        root = p
        index = p / INDEX_FILE
        if index.exists():
            index_map = weight_map(_read_json(allowed(index), "index"), str(index))
            files = [(f, allowed(p / f)) for f in sorted(set(index_map.values()))]
        else:
            files = [(f.name, allowed(f)) for f in sorted(p.glob("*.safetensors"))]
        if not files:
            raise NotFound(f"no safetensors files in {p}")
    tensors = collect([(listed, str(f), _parse_file(f)) for listed, f in files], index_map)
    config: dict[str, Any] = {}
    cfg = root / "config.json"
    if cfg.exists():
        doc = _read_json(allowed(cfg), "config", limit=16 * 1024**2)
        config = doc if isinstance(doc, dict) else {}
    return Checkpoint(str(p.absolute()), tensors, config)


def weight_map(doc: Any, where: str) -> dict[str, str]:
    """A sharded checkpoint's index: tensor name -> the file holding it."""
    index_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(index_map, dict) or not all(isinstance(v, str) for v in index_map.values()):
        raise InvalidArgument(f"{where}: unreadable index (no weight_map of file names)")
    return index_map


def collect(parsed: list[tuple[str, str, list[CheckpointTensor]]],
            index_map: dict[str, str] | None) -> dict[str, CheckpointTensor]:
    """Every file's tensors, by name: ``parsed`` holds (the name the index lists, the file, its tensors). A
    tensor in two files, or in a file the index does not name for it, or listed but absent, is refused."""
    tensors: dict[str, CheckpointTensor] = {}
    for listed, f, found in parsed:
        for t in found:
            if t.name in tensors:
                raise InvalidArgument(f"tensor {clip(t.name)} appears in both {tensors[t.name].file} and {f}")
            if index_map is not None and index_map.get(t.name) != listed:
                raise InvalidArgument(f"{f}: tensor {clip(t.name)} is not listed for this file in the index")
            tensors[t.name] = t
    if index_map is not None:
        missing = sorted(set(index_map) - set(tensors))
        if missing:
            raise InvalidArgument(f"index lists tensors missing from the files: {[clip(m) for m in missing[:5]]}")
    return tensors


def _open_dcp(root: Path, roots: CheckpointRoots | None) -> Checkpoint:
    """A Distributed Checkpoint directory: its chunks (named by ``dcp_files.chunk_name``) and its
    ``.metadata`` file as a ``uint8`` tensor of that name, all in place."""
    raw, chunks = dcp_chunks(root, roots)
    meta_file = root / METADATA_FILE
    located = [(METADATA_FILE, "uint8", (len(raw),), meta_file, 0, len(raw)), *chunks]
    stats = {f: f.stat() for f in {c[3] for c in located}}
    tensors: dict[str, CheckpointTensor] = {}
    for name, dtype, shape, f, offset, nbytes in located:
        if name in tensors:
            raise InvalidArgument(f"{root}: DCP metadata lists chunk {clip(name)} twice")
        st = stats[f]
        tensors[name] = CheckpointTensor(name, dtype, shape, str(f.absolute()), offset, nbytes, st.st_size,
                                         st.st_mtime_ns)
    return Checkpoint(str(root.absolute()), tensors, {}, "dcp")
