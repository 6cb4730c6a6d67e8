"""The disk tier: content-addressed blob files and artifact manifests in a directory, under a capacity.

Owns: ``DIR/blobs/<digest>`` (written to ``DIR/tmp`` first, made durable with fsync, then renamed, so a
blob file is complete or absent), ``DIR/artifacts/<id>`` manifests (the tensor list and placement) that a
restarted worker reads to re-announce its disk replicas, the byte accounting, and which blob files' bytes
are still unchecked against their digest (written by a same-host caller that stated it): ``DIR/checked/
<digest>`` marks a checked one (made after the check, removed before the blob changes, never synced: a
marker lost in a crash only means one more check). Storing a blob whose digest is held already first
checks an unchecked holder, and a holder whose bytes do not match is replaced by the new file (``replaced``
is told). Blob files are never rewritten in place, so readers may map them copy-on-write. Does not own:
placement decisions, or when the other checks happen (``worker.trust``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import blake3
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
        for sub in ("blobs", "tmp", "artifacts", "checked"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.dir / "tmp", ignore_errors=True)  # partial writes of a crashed process
        (self.dir / "tmp").mkdir(exist_ok=True)
        self._blob_refs: dict[str, int] = {}
        self._blob_size: dict[str, int] = {}
        self.manifests: dict[str, Manifest] = {}
        self.reserved = 0
        self._unverified: set[str] = set()  # blob files whose bytes were never checked against their digest
        # Told (on the storing thread) of a blob file replaced because its bytes did not match its digest.
        self.replaced: Callable[[str], None] = lambda digest: None
        self._load()

    @property
    def used(self) -> int:
        return sum(self._blob_size.values())

    def _load(self) -> None:
        checked = {f.name for f in (self.dir / "checked").iterdir()}
        for f in (self.dir / "blobs").iterdir():
            self._blob_size[f.name] = f.stat().st_size
            self._blob_refs[f.name] = 0
            if f.name not in checked:
                self._unverified.add(f.name)
        for name in checked - set(self._blob_size):
            self._mark(name, False)
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

    def commit_upload(self, digest: str, seg: Segment, verified: bool = True) -> None:
        """Make an upload blob ``digest`` (``verified=False``: its bytes were not checked against it). Blocking."""
        self.unreserve(seg.size)
        if digest in self._blob_size and self.check(digest) is not False:
            seg.unlink()
            seg.try_close()
            return
        replacing = digest in self._blob_size  # a holder whose bytes are not ``digest``'s: the upload replaces it
        seg.flush()
        _fsync_path(seg.path)
        self._mark(digest, False)
        self._unverified.add(digest)
        seg.rename(self.blob_path(digest))
        _fsync_path(str(self.dir / "blobs"))
        seg.try_close()
        self._blob_size[digest] = seg.size
        if verified:
            self._checked(digest)
        if replacing:
            self.replaced(digest)
        else:
            self._blob_refs[digest] = 0

    def discard_upload(self, seg: Segment) -> None:
        self.unreserve(seg.size)
        seg.unlink()
        seg.try_close()

    def write_blob(self, digest: str, data: memoryview, verified: bool = True) -> None:
        """Copy bytes held elsewhere (a memory segment) into a durable blob file. Blocking."""
        if digest in self._blob_size and self.check(digest) is not False:
            return
        seg = self.new_upload(len(data))
        try:
            seg.view()[:] = data
        except BaseException:
            self.discard_upload(seg)
            raise
        self.commit_upload(digest, seg, verified)

    # ----------------------------------------------------------------- trust
    def is_unverified(self, digest: str) -> bool:
        return digest in self._unverified and digest in self._blob_size

    @property
    def any_unverified(self) -> bool:
        return bool(self._unverified)

    def is_verified(self, digest: str) -> bool:
        return digest in self._blob_size and digest not in self._unverified

    def unverified_blobs(self) -> list[tuple[str, int]]:
        return [(d, self._blob_size[d]) for d in list(self._unverified) if d in self._blob_size]

    def check(self, digest: str, threads: int = blake3.blake3.AUTO) -> bool | None:
        """Check a held blob file's bytes against its digest (once: a match is remembered). None: not held.
        Blocking: reads the whole file."""
        if digest not in self._blob_size:
            return None
        if digest not in self._unverified:
            return True
        try:
            ok = str(blake3.blake3(max_threads=threads).update_mmap(self.blob_path(digest)).hexdigest()) == digest
        except FileNotFoundError:
            return None
        if ok:
            self._checked(digest)
        return ok

    def _checked(self, digest: str) -> None:
        self._unverified.discard(digest)
        self._mark(digest, True)

    def _mark(self, digest: str, checked: bool) -> None:
        path = self.dir / "checked" / digest
        with contextlib.suppress(OSError):
            if checked:
                path.touch()
            else:
                path.unlink(missing_ok=True)

    def condemn(self, digest: str) -> list[str]:
        """Drop a blob file whose bytes do not match its digest, and every artifact using it (returned)."""
        users = [aid for aid, m in self.manifests.items() if any(t.digest == digest for t in m.tensors)]
        for aid in users:
            self.remove_artifact(aid)
        if digest in self._blob_size and not self._blob_refs.get(digest):
            self._remove_blob(digest)
        return users

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
        self._mark(digest, False)
        del self._blob_refs[digest]
        del self._blob_size[digest]
        self._unverified.discard(digest)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.blob_path(digest))


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
