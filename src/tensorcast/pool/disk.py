"""The disk tier: content-addressed blob files and artifact manifests in a directory, under a capacity.

Owns: ``DIR/blobs/<digest>`` (written to ``DIR/tmp`` first, made durable with fsync, then renamed, so a
blob file is complete or absent), ``DIR/artifacts/<id>`` manifests (the tensor list and placement) that a
restarted worker reads to re-announce its disk replicas, and the byte accounting. Blob files are never
rewritten in place, so readers may map them copy-on-write. Does not own: placement decisions.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import msgspec

from tensorcast.errors import ResourceExhausted
from tensorcast.pool.segments import Segment
from tensorcast.records import TensorMeta

__all__ = ["DiskTier", "Manifest"]


class Manifest(msgspec.Struct, frozen=True):
    artifact_id: str
    tensors: tuple[TensorMeta, ...]
    policy: str = "durable"


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(Manifest)


class DiskTier:
    def __init__(self, directory: str | Path, capacity: int) -> None:
        self.dir = Path(directory)
        self.capacity = capacity
        for sub in ("blobs", "tmp", "artifacts"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.dir / "tmp", ignore_errors=True)  # partial writes of a crashed process
        (self.dir / "tmp").mkdir(exist_ok=True)
        self._blob_refs: dict[str, int] = {}
        self._blob_size: dict[str, int] = {}
        self.manifests: dict[str, Manifest] = {}
        self.reserved = 0
        self._load()

    @property
    def used(self) -> int:
        return sum(self._blob_size.values())

    def _load(self) -> None:
        for f in (self.dir / "blobs").iterdir():
            self._blob_size[f.name] = f.stat().st_size
            self._blob_refs[f.name] = 0
        for f in (self.dir / "artifacts").iterdir():
            try:
                m = _DEC.decode(f.read_bytes())
            except (OSError, msgspec.DecodeError, msgspec.ValidationError):
                f.unlink()
                continue
            if all(t.nbytes == 0 or t.digest in self._blob_size for t in m.tensors):
                self._add_manifest(m)
            else:
                f.unlink()  # a blob is missing: the replica is incomplete
        for d in [d for d, n in self._blob_refs.items() if n == 0]:
            self._remove_blob(d)

    def blob_path(self, digest: str) -> str:
        return str(self.dir / "blobs" / digest)

    def has_blob(self, digest: str) -> bool:
        return digest in self._blob_size

    def has_artifact(self, artifact_id: str) -> bool:
        return artifact_id in self.manifests

    # ----------------------------------------------------------------- writing
    def reserve(self, nbytes: int) -> None:
        if self.used + self.reserved + nbytes > self.capacity:
            raise ResourceExhausted(f"disk tier full: {nbytes} bytes requested, "
                                    f"{self.capacity - self.used - self.reserved} of {self.capacity} free")
        self.reserved += nbytes

    def unreserve(self, nbytes: int) -> None:
        self.reserved -= nbytes

    def new_upload(self, nbytes: int) -> Segment:
        """A reserved, mapped temp file to receive a blob; ``commit_upload`` makes it durable."""
        self.reserve(nbytes)
        try:
            return Segment.create(str(self.dir / "tmp"), "up", nbytes)
        except BaseException:
            self.unreserve(nbytes)
            raise

    def commit_upload(self, digest: str, seg: Segment) -> None:
        self.unreserve(seg.size)
        if digest in self._blob_size:
            seg.unlink()
            seg.try_close()
            return
        seg.flush()
        _fsync_path(seg.path)
        seg.rename(self.blob_path(digest))
        _fsync_path(str(self.dir / "blobs"))
        seg.try_close()
        self._blob_size[digest] = seg.size
        self._blob_refs[digest] = 0

    def discard_upload(self, seg: Segment) -> None:
        self.unreserve(seg.size)
        seg.unlink()
        seg.try_close()

    def write_blob(self, digest: str, data: memoryview) -> None:
        """Copy bytes held elsewhere (a memory segment) into a durable blob file."""
        if digest in self._blob_size:
            return
        seg = self.new_upload(len(data))
        try:
            seg.view()[:] = data
        except BaseException:
            self.discard_upload(seg)
            raise
        self.commit_upload(digest, seg)

    def add_artifact(self, manifest: Manifest) -> None:
        if manifest.artifact_id in self.manifests:
            return
        path = self.dir / "artifacts" / manifest.artifact_id
        tmp = self.dir / "tmp" / f"{manifest.artifact_id}.manifest"
        tmp.write_bytes(_ENC.encode(manifest))
        _fsync_path(str(tmp))
        os.replace(tmp, path)
        _fsync_path(str(self.dir / "artifacts"))
        self._add_manifest(manifest)

    def _add_manifest(self, m: Manifest) -> None:
        self.manifests[m.artifact_id] = m
        for d in {t.digest for t in m.tensors if t.nbytes}:
            self._blob_refs[d] += 1

    # ----------------------------------------------------------------- removal
    def remove_artifact(self, artifact_id: str) -> bool:
        m = self.manifests.pop(artifact_id, None)
        if m is None:
            return False
        with contextlib.suppress(FileNotFoundError):
            (self.dir / "artifacts" / artifact_id).unlink()
        for d in {t.digest for t in m.tensors if t.nbytes}:
            self._blob_refs[d] -= 1
            if self._blob_refs[d] == 0:
                self._remove_blob(d)
        return True

    def _remove_blob(self, digest: str) -> None:
        del self._blob_refs[digest]
        del self._blob_size[digest]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.blob_path(digest))


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
