"""Loading replicas into a worker (part of the basic role): prefetch, pins, rank views, device copies,
checkpoints registered in place.

Owns: the ``Prefetch`` handler (routed to the worker it names; pulls the artifact into memory with the
storage role's ``Fetcher``, or materializes one tensor-parallel rank's view as an artifact of its own,
optionally also onto a CUDA device for same-host CUDA IPC hand-offs), recording the new replica at the
global store, ``RegisterCheckpoint`` (a safetensors checkpoint registered where it lies, by location
digests, never read here, and only under the allowed roots: ``weights.files``; or in object storage, only
under the allowed prefixes: ``weights.object_checkpoint``) and re-opening those registrations after a
restart. A checkpoint in object storage that another worker registered is first read once by that worker,
then copied from it (``_bucket_reader``), so that several workers loading it read the bucket once. Does
not own: the bytes' storage (``worker.storage``, seen through its ``StoragePort``), moving them
(``worker.fetch``).
"""

from __future__ import annotations

import asyncio
import json
import logging

import blake3
import msgspec

from tensorcast.cuda import check_device
from tensorcast.errors import InvalidArgument, NotFound, TensorCastError, clip
from tensorcast.limits import check_ttl
from tensorcast.obs import metrics
from tensorcast.records import ArtifactInfo, ReplicaInfo, TensorMeta
from tensorcast.tensors import ARTIFACT_ID_RE, artifact_id, wrap_bytes
from tensorcast.transport.h2d import to_device
from tensorcast.weights import object_store
from tensorcast.weights.files import CheckpointRoots
from tensorcast.weights.object_checkpoint import open_object_checkpoint
from tensorcast.weights.object_store import ObjectPrefixes, is_object_url
from tensorcast.weights.safetensors import Checkpoint, CheckpointTensor, open_checkpoint
from tensorcast.wire.messages import ArtifactReply, Prefetch, Prefetched, RegisterCheckpoint
from tensorcast.wire.rpc import HandlerRegistry, Request
from tensorcast.worker.roles import StoragePort, WorkerParts
from tensorcast.worker.storage import nbytes_of

__all__ = ["LoadingRole", "checkpoint_metas"]

log = logging.getLogger("tensorcast.worker")


class LoadingRole:
    def __init__(self, parts: WorkerParts, storage: StoragePort) -> None:
        self.parts = parts
        self.storage = storage
        self.store = storage.store
        worker = parts.config.worker
        self.roots = CheckpointRoots([*parts.config.weights.allowed_roots, worker.data_dir])
        self.prefixes = ObjectPrefixes(parts.config.weights.object_prefixes)
        object_store.configure(parts.config.weights)  # the settings this process's s3:// reads use

    def register(self, registry: HandlerRegistry) -> None:
        registry.register(Prefetch, self.prefetch)
        registry.register(RegisterCheckpoint, self.register_checkpoint)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    # ----------------------------------------------------------------- prefetch
    async def prefetch(self, msg: Prefetch, req: Request) -> Prefetched:
        if msg.worker_id not in ("", self.parts.worker_id):
            return await self.parts.peers.call(msg.worker_id, msg, req.ctx)
        device = check_device(msg.device) if msg.device else ""  # refused before any work
        if msg.pin_ttl is not None:
            check_ttl(msg.pin_ttl, "pin_ttl")
        info = await self.parts.gs.get_artifact(msg.artifact_id, req.ctx)
        if (registrar := self._bucket_reader(info)) is not None:
            info = await self._shared_from(registrar, info, req)
        if msg.view is not None:
            done = await self._materialize_view(info, msg, req)
            if device:
                await self._copy_to_device(msg.view_id, device)
            return done
        try:
            result = await self.storage.fetch(info, req.ctx.deadline, req.ctx.trace_id, msg.streams)
        except TensorCastError as exc:
            metrics.operation("transfer", "fetch", 0, 0.0, exc.code)
            raise
        if device:
            await self._copy_to_device(info.id, device)
        if msg.pin:
            self.store.pin(info.id, msg.pin_ttl)
        self.storage.fetched("fetch", result)
        if not result.already_present:
            try:
                await self.parts.gs.add_replica(info.id, ("memory",), req.ctx)
            except NotFound:
                self.storage.drop(info.id)  # deleted (or evicted everywhere) while it was being copied
                raise
            log.info("prefetched %s from %s (%d bytes, %.3fs, %d retries)", info.id, result.source or "local disk",
                     result.bytes_moved, result.seconds, result.retries)
        return msgspec.structs.replace(result, artifact=self._with_my_replica(info))

    def _bucket_reader(self, info: ArtifactInfo) -> str | None:
        """The worker that registered ``info`` from object storage, when it is another one and no worker holds
        it in memory yet: that worker reads it from the bucket once, and this one (and every other) copies
        from it worker-to-worker, instead of each reading the bucket through it."""
        if not is_object_url(info.meta.get("source", "")) or info.id in self.store.external:
            return None
        if any(r.tier == "memory" and r.alive for r in info.replicas):
            return None
        return next((r.worker_id for r in info.replicas if r.tier == "disk" and r.alive), None)

    async def _shared_from(self, registrar: str, info: ArtifactInfo, req: Request) -> ArtifactInfo:
        """``info`` after ``registrar`` holds it in memory (concurrent asks share its one read); as it was
        when that fails (memory full there: this worker then reads through it, slices only)."""
        try:
            await self.parts.peers.call(registrar, Prefetch(artifact_id=info.id, worker_id=registrar), req.ctx)
        except TensorCastError as exc:
            log.warning("no shared copy of %s on %s (%s); reading the bucket through it", info.id, registrar, exc)
            return info
        return await self.parts.gs.get_artifact(info.id, req.ctx)

    def _with_my_replica(self, info: ArtifactInfo) -> ArtifactInfo:
        """``info`` with this worker's memory replica listed (as the global store now records it)."""
        me = ReplicaInfo(worker_id=self.parts.worker_id, address=self.parts.address, host_id=self.parts.host_id,
                         tier="memory", data_address=self.storage.data_address)
        others = tuple(r for r in info.replicas if not (r.worker_id == me.worker_id and r.tier == "memory"))
        return msgspec.structs.replace(info, replicas=(me, *others))

    async def _copy_to_device(self, artifact_id: str, device: str) -> None:
        """Copy a memory replica to ``device`` (pipelined H2D), kept for CUDA IPC hand-offs."""
        devices = self.storage.devices
        if devices.has(artifact_id, device):
            return
        metas = self.store.memory.tensors(artifact_id)
        await self.storage.trust.ensure_read(artifact_id, (t.name for t in metas), "memory")  # hand out checked bytes
        nbytes = nbytes_of(metas)
        devices.reserve(nbytes)
        releases = []
        try:
            host = {}
            for t in metas:
                src, _tier, release = self.store.lease_tensor(artifact_id, t, "memory")
                releases.append(release)
                host[t.name] = wrap_bytes(src, t, "numpy")
            tensors = await asyncio.to_thread(to_device, host, device)
        except BaseException:
            devices.unreserve(nbytes)
            raise
        finally:
            for release in releases:
                release()
        devices.add(artifact_id, device, tensors, nbytes)
        log.info("copied %s to %s (%d bytes)", artifact_id, device, nbytes)

    async def _materialize_view(self, info: ArtifactInfo, msg: Prefetch, req: Request) -> Prefetched:
        assert msg.view is not None
        if not ARTIFACT_ID_RE.match(msg.view_id):
            raise InvalidArgument(f"view_id {clip(msg.view_id)} is not an artifact id")
        result, tensors = await self.storage.materialize_view(info, msg.view, msg.view_id, req.ctx.deadline,
                                                               req.ctx.trace_id)
        if msg.pin:
            self.store.pin(msg.view_id, msg.pin_ttl)
        self.storage.fetched("view", result)
        if not result.already_present:
            view_info = ArtifactInfo(id=msg.view_id, tensors=tensors, nbytes=nbytes_of(tensors), policy="cache",
                                     meta={**msg.view_meta, "view_of": info.id})
            await self.parts.gs.commit_artifact(view_info, req.ctx)
            log.info("materialized view %s of %s (%d bytes, %.3fs)", msg.view_id, info.id, result.bytes_moved,
                     result.seconds)
        return result

    # ----------------------------------------------------------------- checkpoints in place
    async def register_checkpoint(self, msg: RegisterCheckpoint, req: Request) -> ArtifactReply:
        ckpt = await asyncio.to_thread(self._open, msg.path)
        metas = checkpoint_metas(ckpt)
        aid = artifact_id(metas)
        self.store.add_external(aid, metas, dict(ckpt.tensors), msg.verify_checksums, ckpt.path)
        meta = {"source": ckpt.path, "format": ckpt.format, "model_type": ckpt.model_type,
                "config": json.dumps(ckpt.config)}
        info = ArtifactInfo(id=aid, tensors=metas, nbytes=nbytes_of(metas), policy="durable", meta=meta)
        done = await self.parts.gs.commit_artifact(info, req.ctx, key=msg.key, tiers=("disk",))
        log.info("registered checkpoint %s as %s (%d tensors, %d bytes, not read)", ckpt.path, aid, len(metas),
                 info.nbytes)
        return ArtifactReply(artifact=done)

    def _open(self, path: str) -> Checkpoint:
        """A checkpoint's layout (headers only), from a local path or an s3:// URL this worker may read."""
        if is_object_url(path):
            return open_object_checkpoint(path, object_store.object_store(), self.prefixes)
        return open_checkpoint(path, self.roots)

    async def restore_checkpoints(self) -> None:
        """Checkpoints registered in place before a restart: re-open them (unchanged files only)."""
        for aid, path, verify in self.store.external_registrations():
            if aid in self.store.external:
                continue
            try:
                ckpt = await asyncio.to_thread(self._open, path)
            except TensorCastError as exc:
                log.warning("checkpoint %s registered as %s is no longer usable: %s", path, aid, exc)
                continue
            metas = checkpoint_metas(ckpt)
            if artifact_id(metas) == aid:
                self.store.add_external(aid, metas, dict(ckpt.tensors), verify, ckpt.path)


def checkpoint_metas(ckpt: Checkpoint) -> tuple[TensorMeta, ...]:
    return tuple(sorted((TensorMeta(name=t.name, dtype=t.dtype, shape=t.shape, nbytes=t.nbytes,
                                    digest=_location_digest(t)) for t in ckpt.tensors.values()),
                        key=lambda m: m.name))


def _location_digest(t: CheckpointTensor) -> str:
    """Identity of a tensor inside a checkpoint file registered in place: where it is, not its content
    (reading every byte to hash it is what from_disk avoids). Re-registering unchanged files is a no-op."""
    etag = f":{t.etag}" if t.etag else ""  # an object's version (the same key may be overwritten)
    return str(blake3.blake3(f"file:{t.file}:{t.file_size}:{t.file_mtime_ns}:{t.offset}:{t.nbytes}{etag}".encode())
               .hexdigest())
