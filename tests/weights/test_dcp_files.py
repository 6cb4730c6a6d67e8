"""A Distributed Checkpoint directory (``FileSystemWriter``'s files) located in place for registration: every
chunk's bytes where they lie, no pickle of the directory run, hostile or unservable directories refused with
a clear error."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp  # noqa: E402

from tensorcast.errors import InvalidArgument, PermissionDenied  # noqa: E402
from tensorcast.weights import open_checkpoint  # noqa: E402
from tensorcast.weights.dcp_files import dcp_metadata_classes, load_dcp_metadata  # noqa: E402
from tensorcast.weights.files import CheckpointRoots  # noqa: E402


def _save(path: Path, state: dict[str, Any]) -> Path:
    with pytest.warns(UserWarning):  # DCP warns that it saves in one process
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    return path


def _state() -> dict[str, Any]:
    big = torch.arange(100, dtype=torch.float32).reshape(10, 10)
    return {"model": {"w": torch.randn(6, 4, generator=torch.Generator().manual_seed(0)),
                      "b": torch.arange(5, dtype=torch.bfloat16), "rows": big[2:4], "ids": torch.arange(7)},
            "step": 1200, "name": "run7"}


def _read(t: Any) -> bytes:
    with open(t.file, "rb") as f:
        f.seek(t.offset)
        return f.read(t.nbytes)


def test_every_chunk_is_located_where_it_lies(tmp_path: Path) -> None:
    state = _state()
    ckpt = open_checkpoint(_save(tmp_path / "ck", state))
    assert ckpt.format == "dcp"
    assert set(ckpt.tensors) == {".metadata", "step", "name", "model.w@0,0", "model.b@0", "model.rows@0,0",
                                 "model.ids@0"}
    for name, want in state["model"].items():
        t = next(t for n, t in ckpt.tensors.items() if n.startswith(f"model.{name}@"))
        assert t.shape == tuple(want.shape) and t.nbytes == want.numel() * want.element_size()
        assert _read(t) == want.contiguous().view(torch.uint8).numpy().tobytes(), name
    # Items DCP writes as bytes are served whole, as DCP wrote them (its reader unpickles them, not ours).
    assert torch.load(io.BytesIO(_read(ckpt.tensors["step"])), weights_only=False) == 1200
    assert _read(ckpt.tensors[".metadata"]) == (tmp_path / "ck" / ".metadata").read_bytes()


def test_metadata_reads_as_torch_objects_for_a_caller_with_torch(tmp_path: Path) -> None:
    path = _save(tmp_path / "ck", _state())
    ours = load_dcp_metadata((path / ".metadata").read_bytes(), dcp_metadata_classes())
    theirs = dcp.FileSystemReader(str(path)).read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata and ours.storage_data == theirs.storage_data


def test_a_metadata_pickle_that_runs_code_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    path = _save(tmp_path / "ck", _state())
    marker = tmp_path / "ran"

    class Attack:
        def __reduce__(self) -> Any:
            return os.system, (f"touch {marker}",)

    (path / ".metadata").write_bytes(pickle.dumps(Attack()))
    with pytest.raises(InvalidArgument, match=r"posix\.system|refused"):
        open_checkpoint(path)
    with pytest.raises(InvalidArgument):  # the caller's side (with torch's classes) refuses it too
        load_dcp_metadata((path / ".metadata").read_bytes(), dcp_metadata_classes())
    assert not marker.exists()
    (path / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(InvalidArgument, match="unreadable DCP metadata"):
        open_checkpoint(path)


def _rewrite_storage(path: Path, **changes: Any) -> None:
    md = pickle.loads((path / ".metadata").read_bytes())
    index = next(i for i in md.storage_data if i.fqn == "model.w")
    for field, value in changes.items():
        setattr(md.storage_data[index], field, value)
    (path / ".metadata").write_bytes(pickle.dumps(md))


@pytest.mark.parametrize("changes, match", [
    ({"relative_path": "../outside.distcp"}, "outside the checkpoint"),
    ({"relative_path": "/etc/passwd"}, "outside the checkpoint"),
    ({"offset": 10**12}, "truncated"),
    ({"length": 20}, "unreadable tensor archive|not a tensor archive"),
    ({"transform_descriptors": ["zstd"]}, "transformed"),
])
def test_chunks_that_cannot_be_served_in_place_are_refused(tmp_path: Path, changes: dict[str, Any],
                                                           match: str) -> None:
    path = _save(tmp_path / "ck", _state())
    _rewrite_storage(path, **changes)
    with pytest.raises(InvalidArgument, match=match):
        open_checkpoint(path)


def test_a_transposed_chunk_is_refused_with_the_way_out(tmp_path: Path) -> None:
    path = _save(tmp_path / "ck", {"t": torch.arange(12, dtype=torch.float32).reshape(3, 4).t()})
    with pytest.raises(InvalidArgument, match=r"strides \(1, 4\).*contiguous"):
        open_checkpoint(path)


def test_a_truncated_data_file_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path / "ck", _state())
    data = next(path.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-200])
    with pytest.raises(InvalidArgument):
        open_checkpoint(path)


def test_a_directory_outside_the_allowed_roots_is_refused_before_a_byte_is_read(tmp_path: Path) -> None:
    path = _save(tmp_path / "ck", _state())
    with pytest.raises(PermissionDenied):
        open_checkpoint(path, CheckpointRoots([str(tmp_path / "elsewhere")]))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x.distcp").write_bytes(next(path.glob("*.distcp")).read_bytes())
    link = path / "link.distcp"
    link.symlink_to(outside / "x.distcp")
    _rewrite_storage(path, relative_path="link.distcp")
    with pytest.raises(PermissionDenied):  # a data file that resolves outside the roots
        open_checkpoint(path, CheckpointRoots([str(path)]))
