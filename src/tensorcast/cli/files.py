"""Files in and out of the pool for the command line: ``.npy`` and ``.safetensors``, with progress for large ones.

Owns: turning a user's file into tensors (plus a safetensors file's ``__metadata__``) and tensors back into
a file, with every file problem raised as ``InvalidArgument`` naming the file; uploading and downloading
them with a client it is given, including the companion artifact that carries safetensors metadata; sizes
in binary units and the byte progress bars that show them; what ``rm`` says it did. Does not own: flags,
connections, or which console output goes to (``cli.commands``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TimeElapsedColumn
from rich.text import Text

from tensorcast.errors import InvalidArgument, NotFound
from tensorcast.tensors import dtype_name, numpy_dtype
from tensorcast.weights.safetensors import SAFETENSORS_DTYPES

if TYPE_CHECKING:
    from tensorcast.client.artifact import Deletion
    from tensorcast.client.sync import Artifact, Client

__all__ = [
    "METADATA_SUFFIX",
    "PROGRESS_BYTES",
    "FileTensors",
    "byte_progress",
    "check_suffix",
    "checkpoint_files",
    "deleted_line",
    "download",
    "get_metadata",
    "output_file",
    "put_metadata",
    "read_tensors",
    "size",
    "upload",
    "write_tensors",
]

# Files and artifacts above this size get a progress bar; smaller ones finish before a bar would help.
PROGRESS_BYTES = 64 * 2**20
# Artifacts hold tensors only, and the client takes no artifact metadata, so a safetensors file's
# ``__metadata__`` travels as a companion artifact under KEY + this suffix: one uint8 tensor of its JSON.
METADATA_SUFFIX = ".__metadata__"
_CHUNK = 16 * 2**20


def size(n: float) -> str:
    """Bytes in binary units, one decimal above bytes: ``512 B``, ``1.5 KiB``, ``3.0 GiB``, ``2.0 TiB``."""
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if round(n, 1) < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} TiB"


class _BytesColumn(ProgressColumn):
    """``done / total`` in the same units as every other size the command line prints."""

    def render(self, task: Task) -> Text:
        total = f" / {size(task.total)}" if task.total is not None else ""
        return Text(f"{size(task.completed)}{total}", style="progress.download")


class _SpeedColumn(ProgressColumn):
    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{size(speed)}/s" if speed else "", style="progress.data.speed")


def byte_progress(console: Console) -> Progress:
    """Bars for byte counts: one task per phase (reading, uploading, downloading)."""
    return Progress("[progress.description]{task.description}", BarColumn(), _BytesColumn(), _SpeedColumn(),
                    TimeElapsedColumn(), console=console)


@dataclass
class FileTensors:
    tensors: np.ndarray[Any, Any] | dict[str, np.ndarray[Any, Any]]
    metadata: dict[str, str] | None  # a safetensors file's __metadata__, if it has one


def check_suffix(path: Path, what: str) -> None:
    if path.suffix not in (".npy", ".safetensors"):
        raise InvalidArgument(f"{what} must end in .npy or .safetensors, got {path}")


def read_tensors(path: Path, progress: Progress | None) -> FileTensors:
    """A ``.npy`` file's array or a ``.safetensors`` file's tensors and metadata, read into memory."""
    return FileTensors(_read_npy(path, progress), None) if path.suffix == ".npy" else _read_safetensors(path, progress)


def _read_npy(path: Path, progress: Progress | None) -> np.ndarray[Any, Any]:
    """Parses the header itself (not ``np.load``) so that the data can be read in chunks with progress and
    every problem names the file: not an .npy, Python objects, unsupported dtype, truncated."""
    fmt = np.lib.format  # untyped in numpy's stubs, hence the ignores below
    try:
        with open(path, "rb") as f:
            version = fmt.read_magic(f)  # type: ignore[no-untyped-call]
            if version not in ((1, 0), (2, 0)):
                # 3.0 exists only for structured dtypes with non-Latin-1 field names: not tensors.
                raise InvalidArgument(f"{path}: .npy format version {version} is not supported")
            read_header = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
            shape, fortran_order, dtype = read_header(f)  # type: ignore[no-untyped-call]
            if dtype.hasobject:
                raise InvalidArgument(f"{path}: holds Python objects (saved with allow_pickle); only numeric "
                                      "arrays can be stored")
            try:
                dtype_name(dtype)
            except InvalidArgument as exc:
                raise InvalidArgument(f"{path}: {exc.message}") from None
            expected, available = math.prod(shape) * dtype.itemsize, os.fstat(f.fileno()).st_size - f.tell()
            if available < expected:  # checked before allocating what a broken header may claim
                raise InvalidArgument(f"{path}: truncated: the header promises {expected} bytes of data, the "
                                      f"file holds {available}")
            flat = np.empty(math.prod(shape), dtype)
            _read_into(f, flat.view(np.uint8), path, _tracker(progress, f"reading {path.name}", flat.nbytes))
    except ValueError as exc:  # numpy's error for a bad magic string or header
        raise InvalidArgument(f"{path}: not a readable .npy file ({exc})") from None
    except OSError as exc:
        raise InvalidArgument(f"{path}: cannot read ({exc.strerror or exc})") from None
    return flat.reshape(shape, order="F" if fortran_order else "C")


def _tracker(progress: Progress | None, description: str, total: int) -> Callable[[int], None]:
    """A callback that advances one progress task by a byte count (nothing without a progress display)."""
    if progress is None:
        return lambda n: None
    task = progress.add_task(description, total=total)
    return lambda n: progress.advance(task, n)


def _read_into(f: Any, buf: np.ndarray[Any, Any], path: Path, advance: Callable[[int], None]) -> None:
    done = 0
    while done < buf.nbytes:
        n = f.readinto(buf[done:done + _CHUNK])
        if not n:  # the file shrank while being read
            raise InvalidArgument(f"{path}: ends after {done} of {buf.nbytes} bytes of data")
        done += n
        advance(n)


def _read_safetensors(path: Path, progress: Progress | None) -> FileTensors:
    """``safe_open`` checks the file (header, offsets) and gives its metadata; the bytes are read here, into
    arrays of TensorCast's dtypes, so that dtypes numpy lacks (FP8: ``ml_dtypes``) load as ``load`` and ``get``
    handle them."""
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError:
        raise InvalidArgument("reading .safetensors needs the safetensors package") from None
    tensors: dict[str, np.ndarray[Any, Any]] = {}
    try:
        with safe_open(str(path), "np") as f:
            metadata = f.metadata()
        with open(path, "rb") as raw:  # valid (safe_open checked it): 8-byte header length, header, data
            hlen = int.from_bytes(raw.read(8), "little")
            header = json.loads(raw.read(hlen))
            entries = sorted(((name, e) for name, e in header.items() if name != "__metadata__"),
                             key=lambda item: int(item[1]["data_offsets"][0]))
            advance = _tracker(progress, f"reading {path.name}",
                               sum(int(e["data_offsets"][1]) - int(e["data_offsets"][0]) for _, e in entries))
            for name, entry in entries:
                dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
                if dtype is None:
                    raise InvalidArgument(f"{path}: tensor {name}: dtype {entry['dtype']} is not supported")
                array = np.empty(tuple(entry["shape"]), numpy_dtype(dtype))
                raw.seek(8 + hlen + int(entry["data_offsets"][0]))
                _read_into(raw, array.reshape(-1).view(np.uint8), path, advance)
                tensors[name] = array
    except (SafetensorError, ValueError, TypeError, KeyError) as exc:  # bad header, truncated data
        raise InvalidArgument(f"{path}: not a readable safetensors file ({exc})") from None
    except OSError as exc:
        raise InvalidArgument(f"{path}: cannot read ({exc.strerror or exc})") from None
    return FileTensors(tensors, dict(metadata) if metadata else None)


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint (a file, or a directory of them): what registration reads."""
    return [path] if path.is_file() else sorted(path.glob("*.safetensors"))


@contextlib.contextmanager
def output_file(out: Path) -> Iterator[Path]:
    """A temporary file next to ``out``, renamed to ``out`` once written: a failed write leaves neither a
    half-written ``out`` nor a clobbered old one. Created first, so a missing or read-only directory fails
    before anything is downloaded."""
    part = out.with_name(f".{out.name}.{os.getpid()}.part")
    try:
        part.open("xb").close()
    except (FileNotFoundError, NotADirectoryError):
        raise InvalidArgument(f"{out}: directory {out.parent} does not exist") from None
    except OSError as exc:
        raise InvalidArgument(f"{out}: cannot write to {out.parent} ({exc.strerror or exc})") from None
    try:
        yield part
        try:
            os.replace(part, out)
        except OSError as exc:
            raise InvalidArgument(f"{out}: cannot write ({exc.strerror or exc})") from None
    finally:
        part.unlink(missing_ok=True)


def write_tensors(out: Path, part: Path, tensors: dict[str, Any], metadata: dict[str, str] | None) -> None:
    """Write ``tensors`` to ``part`` in ``out``'s format (``.npy``: exactly one tensor)."""
    if out.suffix == ".npy" and len(tensors) != 1:
        raise InvalidArgument(f"{out}: a .npy file holds one tensor, the artifact has {len(tensors)}; write "
                              ".safetensors instead")
    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    try:
        if out.suffix == ".npy":
            with open(part, "wb") as f:  # a file object: np.save would append .npy to a name
                np.save(f, np.asarray(next(iter(tensors.values()))), allow_pickle=False)
        else:
            save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(part), metadata=metadata)
    except (OSError, SafetensorError) as exc:  # a full disk, an I/O error
        raise InvalidArgument(f"{out}: cannot write ({exc})") from None


def upload(client: Client, tensors: Any, key: str, ttl: float | None, policy: str | None,
           progress: Progress | None) -> Artifact:
    if progress is None:
        return client.put(tensors, key, ttl=ttl, policy=policy)
    task = progress.add_task("uploading", total=None)  # the client reports no progress within a put
    art = client.put(tensors, key, ttl=ttl, policy=policy)
    progress.update(task, total=art.nbytes, completed=art.nbytes)
    return art


def download(art: Artifact, progress: Progress | None) -> dict[str, Any]:
    if progress is None:
        return art.tensor_dict(like="numpy")
    task = progress.add_task(f"downloading {art.key or art.id}", total=art.nbytes)
    out = {}
    for name in art.tensor_names:  # one tensor at a time, so that the bar moves
        out[name] = art.tensor(name, like="numpy")
        progress.advance(task, art.meta(name).nbytes)
    return out


def put_metadata(client: Client, key: str, metadata: dict[str, str] | None, ttl: float | None,
                 policy: str | None) -> None:
    """Keep KEY's companion in step with KEY: the new file's metadata, or none at all (a stale companion
    would be written back by ``get``)."""
    if not metadata:
        with contextlib.suppress(NotFound):
            client.delete(key + METADATA_SUFFIX)
        return
    # The key is part of the content: artifacts are content-addressed, and equal metadata under two keys
    # must stay two artifacts, or deleting one key's companion would delete the other's.
    doc = json.dumps({"key": key, "metadata": metadata}, sort_keys=True).encode()
    client.put(np.frombuffer(doc, dtype=np.uint8), key + METADATA_SUFFIX, ttl=ttl, policy=policy)


def get_metadata(client: Client, key: str) -> dict[str, str] | None:
    """The safetensors metadata ``put`` kept for KEY, or None."""
    try:
        companion = client.artifact(key + METADATA_SUFFIX)
    except NotFound:
        return None
    try:
        metadata = json.loads(np.asarray(companion.tensor(like="numpy")).tobytes())["metadata"]
    except (ValueError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise InvalidArgument(f"{key}{METADATA_SUFFIX}: not safetensors metadata ({exc!r})") from None
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise InvalidArgument(f"{key}{METADATA_SUFFIX}: not safetensors metadata (not a JSON object of strings)")
    return metadata


def deleted_line(key_or_id: str, done: Deletion) -> str:
    """What ``rm`` says it did: the content gone (a key's last reference, or an id), or a key unbound while
    other references keep the content."""
    if key_or_id == done:
        return f"deleted {done}"
    if done.removed:
        return f"deleted {key_or_id} ({done})"
    kept = f"still named by {', '.join(done.keys)}" if done.keys else "still held by a put without a key"
    return f"deleted {key_or_id}; its content ({done}) stays: {kept}"
