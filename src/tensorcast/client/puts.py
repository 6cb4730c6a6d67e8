"""The put protocol from the caller's side: begin, hand the bytes over, commit (or abort).

Owns: ``PutBegin`` -> bytes -> ``PutCommit`` against the worker that takes the first replica. The digests come
first (so that the worker skips the bytes it holds already). A small put is one request: its bytes are
``PutBegin``'s payload, and the worker stores and commits at once. Same host: one copy of each tensor straight
into the shared-memory segment the worker reserved, through a mapping kept from one put to the next
(``client.write_maps``; a disk-tier target: ``pwrite``). Another host (or a ``/dev/shm`` this process cannot
see): ``PutData`` payloads that the worker receives straight into the segment, each checked against its chunk
checksums and sent again if a chunk arrived corrupted. A same-host put of many bytes not hashed yet hashes them
while it writes them, and its digests go with the commit (``PutBegin.digests_later``); digests known already (a
publisher's unchanged tensors) are stated first, so the worker skips those bytes (which path a put takes:
``client.put_path``). A failed put is aborted, also one whose caller was cancelled while ``PutBegin`` was being
answered (the worker also reclaims abandoned ones). Does not own: normalizing inputs (``tensors``) or the
artifact handle (``client.aio``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tensorcast.checksums import ChunkCorrupted
from tensorcast.client.locality import Locality
from tensorcast.client.put_path import PutPath, PutTurn, after, choose_put_path, on_thread
from tensorcast.client.write_maps import SegmentWriter
from tensorcast.context import CallContext
from tensorcast.errors import InternalError, TensorCastError
from tensorcast.pool.segments import SegmentGone, write_at
from tensorcast.records import ArtifactInfo, Placement
from tensorcast.tensors import TensorInput, digest_bytes
from tensorcast.wire.caller import Caller
from tensorcast.wire.messages import PutAbort, PutBegin, PutCommit, PutData, PutPlan, Request

__all__ = ["PUT_DATA_ATTEMPTS", "put_tensors"]

# Sends of one tensor's bytes whose chunks arrived corrupted before the put fails (ChunkCorrupted).
PUT_DATA_ATTEMPTS = 3
R = TypeVar("R")
log = logging.getLogger("tensorcast.client")
_LATE_ABORTS: set[asyncio.Task[None]] = set()


async def put_tensors(caller: Caller, locality: Locality, writer: SegmentWriter, address: str,
                      inputs: list[TensorInput], *, key: str | None, ttl: float | None,
                      policy: str | Placement | None, ctx: CallContext) -> ArtifactInfo:
    """Store ``inputs`` as one artifact on the worker at ``address`` (same-host bytes written through
    ``writer``); returns its committed record."""
    info = await _put_tensors(caller, locality, writer, address, inputs, key, ttl, policy, ctx)
    if info.copies < info.replicas_wanted:
        log.warning("artifact %s was put with %d of the %d copies its placement wants on live workers (more are "
                    "made as workers can take them)", info.id, info.copies, info.replicas_wanted)
    return info


async def _put_tensors(caller: Caller, locality: Locality, writer: SegmentWriter, address: str,
                       inputs: list[TensorInput], key: str | None, ttl: float | None,
                       policy: str | Placement | None, ctx: CallContext) -> ArtifactInfo:
    welcome = await caller.connect(address)
    put = _Put(caller, writer, address, inputs, key, ttl, policy, ctx)
    same_host = locality.same_host(welcome.host_id)
    path = choose_put_path(sum(t.nbytes for t in inputs), sum(t.nbytes for t in inputs if not t.digest), same_host)
    if path is PutPath.INLINE:
        return await put.inline(same_host)
    if path is not PutPath.STREAMED:
        try:
            return await put.same_host(path)
        except SegmentGone:
            locality.shared_memory_unreachable()
            path = after(path, PutTurn.SHM_UNREACHABLE)
    return await put.streamed()


class _Put:
    """One put's requests to one worker."""

    def __init__(self, caller: Caller, writer: SegmentWriter, address: str, inputs: list[TensorInput],
                 key: str | None, ttl: float | None, policy: str | Placement | None, ctx: CallContext) -> None:
        self.caller, self.writer, self.address, self.inputs, self.ctx = caller, writer, address, inputs, ctx
        self.key, self.ttl, self.policy = key, ttl, policy

    async def _call(self, msg: Request[R]) -> R:
        return await self.caller.call(msg, self.ctx, address=self.address)

    async def _begin_put(self, msg: PutBegin) -> PutPlan:
        """``PutBegin``, whose answer reserves room on the worker. A caller cancelled before the answer came
        does not leave that room reserved until the worker reclaims the put (``worker.put_timeout``,
        minutes): the answer is still awaited, off the caller's path, and the put aborted."""
        answer = asyncio.ensure_future(self._call(msg))
        try:
            return await asyncio.shield(answer)
        except asyncio.CancelledError:
            answer.add_done_callback(self._abort_late)
            raise

    def _abort_late(self, answer: asyncio.Future[PutPlan]) -> None:
        if answer.cancelled() or answer.exception() is not None:
            return
        task = asyncio.ensure_future(_abort(self.caller, answer.result().put_id, self.address))
        _LATE_ABORTS.add(task)  # a reference until it is done (the loop keeps only weak ones)
        task.add_done_callback(_LATE_ABORTS.discard)

    def _begin(self, same_host: bool) -> PutBegin:
        return PutBegin(tensors=tuple(t.meta for t in self.inputs), key=self.key, ttl=self.ttl, same_host=same_host,
                        placement=self.policy)

    async def inline(self, same_host: bool) -> ArtifactInfo:
        """A small put in one request: the bytes travel as its payload (checksummed), and the worker computes
        the digests from them, stores and commits. One round trip instead of two (or three)."""
        msg = PutBegin(tensors=tuple(t.meta_without_digest(t.digest) for t in self.inputs), key=self.key,
                       ttl=self.ttl, same_host=same_host, placement=self.policy, inline=True)
        payload = [memoryview(t.data) for t in self.inputs if t.nbytes]  # type: ignore[arg-type]
        plan = await self.caller.call(msg, self.ctx, address=self.address, payload=payload or None)
        if plan.artifact is None:
            raise InternalError(f"{self.address} answered an inline put without its record")
        return plan.artifact

    async def same_host(self, path: PutPath) -> ArtifactInfo:
        """Write straight into the worker's shared memory (``path``: hashed first, so that the worker skips
        the bytes it holds already, or hashed on other threads while written on another)."""
        try:
            while path is PutPath.HASH_WHILE_WRITING:
                info = await self._hash_while_writing()
                if info is not None:
                    return info
                path = after(path, PutTurn.DIGESTS_FIRST)
            return await self._hash_then_write()
        finally:
            self.writer.schedule_sweep(asyncio.get_running_loop())

    async def _hash_then_write(self) -> ArtifactInfo:
        await _hash(self.inputs)
        plan = await self._begin_put(self._begin(True))
        return await self._finish(plan, lambda: _write(self.writer, plan, self.inputs))

    async def _hash_while_writing(self) -> ArtifactInfo | None:
        """Same host, digests later: the worker reserves room for every tensor not hashed yet, which is written
        while its digest is computed (BLAKE3 is bound by the CPU, the copy by memory: together they take little
        more than the longer of the two), and the digests come with the commit. Bytes the worker held already
        are written all the same and dropped at the commit: about what hashing them first would have cost.
        Tensors whose digest is known (a publisher's unchanged ones) are skipped up front as usual. None: the
        worker asked for the digests first (``PutTurn.DIGESTS_FIRST``)."""
        msg = PutBegin(tensors=tuple(t.meta_without_digest(t.digest) for t in self.inputs), key=self.key,
                       ttl=self.ttl, same_host=True, placement=self.policy, digests_later=True)
        # Hashing starts once the worker has answered: on two cores, hashing meanwhile slows its answer down
        # by more than it saves.
        plan = await self._begin_put(msg)
        if plan.digests_first:  # the worker must make room: with the digests, it skips the bytes it holds
            return None

        async def write() -> None:
            hashing = asyncio.ensure_future(asyncio.to_thread(_hash_all, self.inputs))
            try:
                await _write(self.writer, plan, self.inputs)
            finally:
                await hashing  # the hash is waited for (a copy on a thread, cancelled, still runs to its end)

        return await self._finish(plan, write, digests=lambda: tuple(t.digest for t in self.inputs))

    async def streamed(self) -> ArtifactInfo:
        """Another host: the bytes as checksummed payloads, which the worker checks against the digests."""
        await _hash(self.inputs)
        plan = await self._begin_put(self._begin(False))

        async def send() -> None:
            for i, ref in enumerate(plan.segments):
                if ref is not None:
                    await _send(self.caller, self.address, PutData(put_id=plan.put_id, index=i, offset=0),
                                memoryview(self.inputs[i].data), self.ctx)  # type: ignore[arg-type]

        return await self._finish(plan, send)

    async def _finish(self, plan: PutPlan, transfer: Callable[[], Awaitable[None]],
                      digests: Callable[[], tuple[str, ...]] = tuple) -> ArtifactInfo:
        """Hand the bytes over (unless the worker holds them all), then commit (with ``digests()``, those of a
        put begun with ``digests_later``); abort on any failure."""
        try:
            if not plan.exists:
                await transfer()
            done = await self._call(PutCommit(put_id=plan.put_id, digests=digests()))
        except BaseException:
            await _abort(self.caller, plan.put_id, self.address)
            raise
        return done.artifact


async def _send(caller: Caller, address: str, msg: PutData, data: memoryview, ctx: CallContext) -> None:
    """One tensor's bytes as a checksummed payload; sent again (same offset) while chunks arrive corrupted."""
    for attempt in range(PUT_DATA_ATTEMPTS):
        try:
            await caller.call(msg, ctx, address=address, payload=data)
            return
        except ChunkCorrupted:
            if attempt == PUT_DATA_ATTEMPTS - 1:
                raise


async def _abort(caller: Caller, put_id: str, address: str) -> None:
    # Best effort: the worker reclaims abandoned puts after worker.put_timeout anyway.
    with contextlib.suppress(TensorCastError, asyncio.CancelledError):
        await caller.call(PutAbort(put_id=put_id), CallContext().with_timeout(5.0), address=address)


async def _hash(inputs: list[TensorInput]) -> None:
    """Compute the digests not computed yet (on a thread unless there are few bytes to hash)."""
    if not on_thread(sum(t.nbytes for t in inputs if not t.digest)):
        _hash_all(inputs)
    else:
        await asyncio.to_thread(_hash_all, inputs)


def _hash_all(inputs: list[TensorInput]) -> None:
    for t in inputs:
        if not t.digest:
            t.digest = digest_bytes(t.data)


async def _write(writer: SegmentWriter, plan: PutPlan, inputs: list[TensorInput]) -> None:
    """Same host: write the bytes into the targets; on a thread unless they are few (a thread hop costs more)."""
    if not on_thread(sum(ref.size for ref in plan.segments if ref is not None)):
        _write_segments(writer, plan, inputs)
    else:
        await asyncio.to_thread(_write_segments, writer, plan, inputs)


def _write_segments(writer: SegmentWriter, plan: PutPlan, inputs: list[TensorInput]) -> None:
    """Same host: copy each tensor's bytes once, straight into the segment the worker reserved (the targets
    in one segment, a pack chunk, together): memory segments through the mappings ``writer`` keeps, disk
    files with ``pwrite`` (their pages belong to the page cache of a file on disk)."""
    by_path: dict[tuple[str, str], list[tuple[int, memoryview]]] = {}
    for ref, item in zip(plan.segments, inputs, strict=True):
        if ref is not None:
            by_path.setdefault((ref.tier, ref.path), []).append(
                (ref.offset, memoryview(item.data)))  # type: ignore[arg-type]
    for (tier, path), writes in by_path.items():
        if tier == "disk":
            write_at(path, writes)
        else:
            writer.write(path, writes)
