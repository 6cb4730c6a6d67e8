"""Reading a PyTorch Distributed Checkpoint directory on disk (``FileSystemWriter``'s ``.metadata`` and
``*.distcp`` files) so that it can be registered in place, without torch and without running its pickles.

Owns: the restricted unpickler both sides use for DCP's ``.metadata`` (only the classes DCP writes, mapped to
inert records here; ``dcp_metadata_classes`` lets a caller with torch map the same names to the real ones),
locating each chunk's bytes inside its ``.distcp`` file (a ``torch.save`` archive per tensor chunk: its one
stored data record, found from the archive's directory and checked against the archive's own pickle; raw
bytes for items DCP writes as bytes), and the tensor name each chunk gets. Does not own: registering the
result (``worker.loading``), DCP's planning or the manifest a TensorCast reader needs
(``integrations.torch_dcp``).
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import zipfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tensorcast.errors import InvalidArgument, NotFound, clip
from tensorcast.weights.files import CheckpointRoots, open_regular

__all__ = ["ITEMSIZE", "METADATA_FILE", "chunk_name", "dcp_chunks", "dcp_metadata_classes", "is_dcp_dir",
           "load_dcp_metadata", "stored_name"]

METADATA_FILE = ".metadata"
_MAX_METADATA = 256 * 1024 * 1024
_MAX_ARCHIVE_PICKLE = 64 * 1024
_ZIP_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # 30 bytes: signature ... name length, extra length

# The classes DCP pickles into ``.metadata`` (torch 2.x), by module.
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "TensorProperties",
                                              "ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}
# torch dtype (as pickled: ``torch.float32``) and legacy storage class (``torch.FloatStorage``) -> our name.
_DTYPES = {"float32": "float32", "float": "float32", "float64": "float64", "double": "float64",
           "float16": "float16", "half": "float16", "bfloat16": "bfloat16", "int64": "int64", "long": "int64",
           "int32": "int32", "int": "int32", "int16": "int16", "short": "int16", "int8": "int8",
           "uint8": "uint8", "bool": "bool", "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2",
           "complex64": "complex64", "uint16": "uint16", "uint32": "uint32", "uint64": "uint64"}
_STORAGES = {"FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
             "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16",
             "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool", "ComplexFloatStorage": "complex64",
             "Float8_e4m3fnStorage": "float8_e4m3fn", "Float8_e5m2Storage": "float8_e5m2"}
# Bytes per element of every dtype a checkpoint file may hold (safetensors' and DCP's).
ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "uint32": 4, "int32": 4, "uint64": 8,
            "int64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "float8_e4m3fn": 1,
            "float8_e5m2": 1, "complex64": 8}


class _Record:
    """An inert stand-in for one of DCP's metadata classes: its pickled state, nothing run."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state  # TensorProperties pickles a tuple: (dtype, layout, requires_grad, ...)


class _DType(str):
    """A torch dtype as named in a pickle."""


def _inert(module: str, name: str) -> Any:
    if module == "torch" and name in _DTYPES:
        return _DType(_DTYPES[name])
    if module == "torch" and name == "Size":
        return tuple
    if module == "pathlib":
        return lambda *parts: "/".join(str(p) for p in parts)
    if module == "collections":
        return dict
    if name in ("_get_layout", "_MEM_FORMAT_ENCODING"):
        return lambda value: value
    return type(name, (_Record,), {})


def dcp_metadata_classes() -> Callable[[str, str], Any]:
    """``find_class`` for a caller with torch: the real classes, and only those DCP writes."""
    import importlib

    def find(module: str, name: str) -> Any:
        return getattr(importlib.import_module(module), name)

    return find


class _Unpickler(pickle.Unpickler):
    def __init__(self, raw: bytes, find: Callable[[str, str], Any]) -> None:
        super().__init__(io.BytesIO(raw))
        self._find = find

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()) or (module == "torch" and name in _DTYPES):
            return self._find(module, name)
        raise InvalidArgument(f"DCP metadata names {clip(module, 64)}.{clip(name, 64)}, which a checkpoint's "
                              f"metadata never holds (refused, nothing run)")

    def persistent_load(self, pid: Any) -> Any:
        raise InvalidArgument("DCP metadata holds a persistent reference, which a checkpoint's metadata never holds")


def load_dcp_metadata(raw: bytes, find: Callable[[str, str], Any] = _inert) -> Any:
    """DCP's ``Metadata`` from the bytes of a ``.metadata`` file, through the restricted unpickler (``find``:
    inert records by default, ``dcp_metadata_classes()`` for torch's own)."""
    try:
        return _Unpickler(raw, find).load()
    except InvalidArgument:
        raise
    except Exception as exc:  # a corrupted pickle raises anything from EOFError to struct.error
        raise InvalidArgument(f"unreadable DCP metadata ({exc.__class__.__name__})") from None


def chunk_name(fqn: str, offset: Sequence[int] | None) -> str:
    """A chunk's tensor name: the fully qualified name, plus the chunk's offset for tensor chunks."""
    return fqn if offset is None else f"{fqn}@{','.join(str(int(o)) for o in offset)}"


def stored_name(index: Any, item: Any) -> str:
    """The tensor name the chunk at ``index`` (a ``MetadataIndex``) of ``item`` (its entry in the metadata's
    ``state_dict_metadata``) gets when a directory is registered: the name alone for an item DCP writes as
    bytes, with the chunk's offset for a tensor chunk."""
    if type(item).__name__ == "BytesStorageMetadata":
        return str(index.fqn)
    return chunk_name(index.fqn, tuple(index.offset or ()))


def is_dcp_dir(path: Path) -> bool:
    return path.is_dir() and (path / METADATA_FILE).exists()


class _FileSlice(io.RawIOBase):
    """Bytes ``[start, start + length)`` of an open file, seekable, read with ``pread`` (zipfile reads the
    archive's directory and headers through it, never its data)."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        self.fd, self.start, self.length, self.pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        data = os.pread(self.fd, n, self.start + self.pos) if n else b""
        buffer[:len(data)] = data
        self.pos += len(data)
        return len(data)


def _rebuild(storage: Any, storage_offset: int, size: Any, stride: Any, *_rest: Any) -> tuple[Any, ...]:
    return storage, storage_offset, tuple(size), tuple(stride)


class _ArchiveUnpickler(pickle.Unpickler):
    """A ``torch.save`` archive's ``data.pkl`` of one tensor: where its storage is, its dtype, shape, strides."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in (("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor")):
            return _rebuild
        if module == "torch" and name in _STORAGES:
            return _DType(_STORAGES[name])
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        raise InvalidArgument(f"a tensor archive names {clip(module, 64)}.{clip(name, 64)} (refused)")

    def persistent_load(self, pid: Any) -> Any:
        return pid  # ('storage', dtype, key, location, numel)


def _tensor_span(fd: int, where: str, start: int, length: int, dtype: str, shape: tuple[int, ...]) -> int:
    """The file offset of one chunk's data inside its ``torch.save`` archive at ``[start, start + length)``."""
    try:
        archive = zipfile.ZipFile(_FileSlice(fd, start, length))
        names = {i.filename: i for i in archive.infolist()}
        pkl = next((n for n in names if n.endswith("/data.pkl")), None)
        if pkl is None or names[pkl].file_size > _MAX_ARCHIVE_PICKLE:
            raise InvalidArgument(f"{where}: not a tensor archive")
        rebuilt = _ArchiveUnpickler(io.BytesIO(archive.read(pkl))).load()
    except (zipfile.BadZipFile, EOFError, pickle.UnpicklingError, ValueError, TypeError, KeyError) as exc:
        raise InvalidArgument(f"{where}: unreadable tensor archive ({exc.__class__.__name__})") from None
    if not (isinstance(rebuilt, tuple) and len(rebuilt) == 4 and isinstance(rebuilt[0], tuple)
            and len(rebuilt[0]) == 5):
        raise InvalidArgument(f"{where}: the archive holds something other than one tensor")
    (_kind, stored_dtype, key, _location, numel), storage_offset, size, stride = rebuilt
    if size != shape or stored_dtype != dtype:
        raise InvalidArgument(f"{where}: the archive's tensor ({stored_dtype} {size}) is not the {dtype} {shape} "
                              f"the metadata declares")
    if not _is_contiguous(shape, stride):
        raise InvalidArgument(f"{where}: stored with strides {stride} (a transposed or permuted tensor), which "
                              f"cannot be served in place: save it contiguous (.contiguous()), or load it with DCP")
    record = names.get(pkl.rsplit("/", 1)[0] + f"/data/{key}")
    if record is None or record.compress_type != zipfile.ZIP_STORED:
        raise InvalidArgument(f"{where}: the tensor's data is missing or compressed")
    itemsize = ITEMSIZE[dtype]
    if record.file_size != int(numel) * itemsize or (int(storage_offset) + numel_of(shape)) > int(numel):
        raise InvalidArgument(f"{where}: the tensor's data does not match its shape")
    header = os.pread(fd, _ZIP_LOCAL_HEADER.size, start + record.header_offset)
    if len(header) < _ZIP_LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        raise InvalidArgument(f"{where}: corrupted tensor archive")
    fields = _ZIP_LOCAL_HEADER.unpack(header)
    name_len, extra_len = int(fields[9]), int(fields[10])
    data: int = record.header_offset + _ZIP_LOCAL_HEADER.size + name_len + extra_len + int(storage_offset) * itemsize
    if data + numel_of(shape) * itemsize > length:
        raise InvalidArgument(f"{where}: the tensor's data runs past its archive")
    return start + data


def numel_of(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _is_contiguous(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Row-major and dense (a dimension of size 1 may have any stride, as torch allows)."""
    if len(stride) != len(shape):
        return False
    step = 1
    for size, st in zip(reversed(shape), reversed(stride), strict=True):
        if size != 1 and st != step:
            return False
        step *= int(size)
    return True


def _storage_file(root: Path, relative: Any, roots: CheckpointRoots | None) -> Path:
    if not isinstance(relative, str) or "/" in relative or relative in ("", ".", ".."):
        raise InvalidArgument(f"{root}: DCP metadata names a data file outside the checkpoint: {clip(str(relative))}")
    f = root / relative
    return roots.check(f) if roots is not None else f


def dcp_chunks(root: Path, roots: CheckpointRoots | None) -> tuple[bytes, list[tuple[str, str, tuple[int, ...],
                                                                                     Path, int, int]]]:
    """The ``.metadata`` bytes of the DCP checkpoint directory ``root`` and, for each chunk it lists, ``(name,
    dtype, shape, file, offset, nbytes)``: tensor chunks located inside their archives, byte items whole
    (``uint8``). No tensor data is read."""
    meta_file = _storage_file(root, METADATA_FILE, roots)
    raw = _read_small(meta_file)
    md = load_dcp_metadata(raw)
    entries: Mapping[Any, Any] = getattr(md, "state_dict_metadata", None) or {}
    storage: Mapping[Any, Any] = getattr(md, "storage_data", None) or {}
    if not isinstance(entries, dict) or not isinstance(storage, dict) or not storage:
        raise InvalidArgument(f"{root}: DCP metadata lists no chunks (not a FileSystemWriter checkpoint?)")
    out: list[tuple[str, str, tuple[int, ...], Path, int, int]] = []
    fds: dict[Path, int] = {}
    try:
        for index, info in storage.items():
            fqn, offset = getattr(index, "fqn", None), getattr(index, "offset", None)
            item = entries.get(fqn)
            if not isinstance(fqn, str) or item is None:
                raise InvalidArgument(f"{root}: DCP metadata has a chunk of no listed item")
            if getattr(info, "transform_descriptors", None):
                raise InvalidArgument(f"{root}: chunk {clip(fqn)} is stored transformed (compressed or "
                                      f"encrypted), which cannot be read in place")
            f = _storage_file(root, getattr(info, "relative_path", None), roots)
            start, length = int(getattr(info, "offset", -1)), int(getattr(info, "length", -1))
            if f not in fds:
                fds[f] = open_regular(f)
            if start < 0 or length < 0 or start + length > os.fstat(fds[f]).st_size:
                raise InvalidArgument(f"{f}: chunk {clip(fqn)} runs past the end of the file (truncated)")
            where = f"{f}: {clip(fqn)}"
            if type(item).__name__ == "BytesStorageMetadata":
                out.append((stored_name(index, item), "uint8", (length,), f, start, length))
                continue
            dtype, shape = _chunk_layout(item, offset, where)
            out.append((stored_name(index, item), dtype, shape, f,
                        _tensor_span(fds[f], where, start, length, dtype, shape), numel_of(shape) * ITEMSIZE[dtype]))
    finally:
        for fd in fds.values():
            os.close(fd)
    return raw, out


def _chunk_layout(item: Any, offset: Any, where: str) -> tuple[str, tuple[int, ...]]:
    state = getattr(getattr(item, "properties", None), "state", None)
    dtype = state[0] if isinstance(state, tuple) and state else getattr(getattr(item, "properties", None),
                                                                       "dtype", None)
    if not isinstance(dtype, _DType) or dtype not in ITEMSIZE:
        raise InvalidArgument(f"{where}: unsupported dtype")
    for chunk in getattr(item, "chunks", None) or ():
        if tuple(getattr(chunk, "offsets", ())) == tuple(offset or ()):
            shape = tuple(int(s) for s in getattr(chunk, "sizes", ()))
            if all(s >= 0 for s in shape):
                return str(dtype), shape
    raise InvalidArgument(f"{where}: no chunk at offset {offset} in the metadata")


def _read_small(path: Path) -> bytes:
    if not path.exists():
        raise NotFound(f"{path} does not exist")
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > _MAX_METADATA:
            raise InvalidArgument(f"{path}: {size} bytes is too large for DCP metadata")
        return os.pread(fd, size, 0)
    finally:
        os.close(fd)
