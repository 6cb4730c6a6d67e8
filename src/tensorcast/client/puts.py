"""The put protocol from the caller's side: begin, hand the bytes over, commit (or abort).

Owns: ``PutBegin`` -> bytes -> ``PutCommit`` against the worker that takes the first replica. The digests
come first (so that the worker skips the bytes it holds already). A small put is one request: its bytes are
``PutBegin``'s payload, and the worker stores and commits at once. Same host: one copy of each tensor
straight into the shared-memory segment the worker reserved, through a mapping kept from one put to the
next (``client.write_maps``; a disk-tier target: ``pwrite``). Another host (or a
``/dev/shm`` this process cannot see): ``PutData`` payloads that the worker receives straight into the
segment, each checked against its chunk checksums and sent again if a chunk arrived corrupted. A failed
put is aborted (the worker also reclaims abandoned ones). Does not own: normalizing inputs (``tensors``)
or the artifact handle (``client.aio``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from tensorcast.checksums import ChunkCorrupted
from tensorcast.client.locality import Locality
from tensorcast.client.write_maps import SegmentWriter
from tensorcast.context import CallContext
from tensorcast.errors import InternalError, TensorCastError
from tensorcast.pool.segments import SegmentGone, write_at
from tensorcast.records import ArtifactInfo, Placement
from tensorcast.tensors import TensorInput, digest_bytes
from tensorcast.wire.caller import Caller
from tensorcast.wire.messages import Ack, PutAbort, PutBegin, PutCommit, PutData, PutDone, PutPlan

__all__ = ["PUT_DATA_ATTEMPTS", "put_tensors"]

# Sends of one tensor's bytes whose chunks arrived corrupted before the put fails (ChunkCorrupted).
PUT_DATA_ATTEMPTS = 3
# Same-host writes and hashing of fewer bytes than this run on the event loop (a fraction of a millisecond
# each: a copy into pages faulted in already, BLAKE3 on several threads); a thread hop costs about as much.
_INLINE_WRITE_BYTES = 4 << 20
# Puts of at most this many bytes send them with PutBegin (one round trip; the worker hashes them): below
# this, a round trip costs more than moving the bytes through the connection and hashing them on the worker.
_INLINE_PUT_BYTES = 256 << 10
T = TypeVar("T")


async def put_tensors(caller: Caller, locality: Locality, writer: SegmentWriter, address: str,
                      inputs: list[TensorInput], *, key: str | None, ttl: float | None,
                      policy: str | Placement | None, ctx: CallContext) -> ArtifactInfo:
    """Store ``inputs`` as one artifact on the worker at ``address`` (same-host bytes written through
    ``writer``); returns its committed record."""
    welcome = await caller.connect(address)
    put = _Put(caller, writer, address, inputs, key, ttl, policy, ctx)
    if sum(t.nbytes for t in inputs) <= _INLINE_PUT_BYTES:
        return await put.inline(locality.same_host(welcome.host_id))
    if locality.same_host(welcome.host_id):
        try:
            return await put.same_host()
        except SegmentGone:
            # Same host id, but /dev/shm is not shared (another container): stream instead.
            locality.shared_memory_unreachable()
    return await put.streamed()


class _Put:
    """One put's requests to one worker."""

    def __init__(self, caller: Caller, writer: SegmentWriter, address: str, inputs: list[TensorInput],
                 key: str | None, ttl: float | None, policy: str | Placement | None, ctx: CallContext) -> None:
        self.caller, self.writer, self.address, self.inputs, self.ctx = caller, writer, address, inputs, ctx
        self.key, self.ttl, self.policy = key, ttl, policy

    async def _call(self, msg: Any, expect: type[T]) -> T:
        return await self.caller.call(msg, expect, self.ctx, address=self.address)

    def _begin(self, same_host: bool) -> PutBegin:
        return PutBegin(tensors=tuple(t.meta for t in self.inputs), key=self.key, ttl=self.ttl, same_host=same_host,
                        placement=self.policy)

    async def inline(self, same_host: bool) -> ArtifactInfo:
        """A small put in one request: the bytes travel as its payload (checksummed), and the worker computes
        the digests from them, stores and commits. One round trip instead of two (or three)."""
        msg = PutBegin(tensors=tuple(t.meta_without_digest(t.digest) for t in self.inputs), key=self.key,
                       ttl=self.ttl, same_host=same_host, placement=self.policy, inline=True)
        payload = [memoryview(t.data) for t in self.inputs if t.nbytes]  # type: ignore[arg-type]
        plan = await self.caller.call(msg, PutPlan, self.ctx, address=self.address, payload=payload or None)
        if plan.artifact is None:
            raise InternalError(f"{self.address} answered an inline put without its record")
        return plan.artifact

    async def same_host(self) -> ArtifactInfo:
        """Write straight into the worker's shared memory, the bytes it holds already skipped."""
        await _hash(self.inputs)
        plan = await self._call(self._begin(True), PutPlan)
        try:
            return await self._finish(plan, lambda: _write(self.writer, plan, self.inputs))
        finally:
            self.writer.schedule_sweep(asyncio.get_running_loop())

    async def streamed(self) -> ArtifactInfo:
        """Another host: the bytes as checksummed payloads, which the worker checks against the digests."""
        await _hash(self.inputs)
        plan = await self._call(self._begin(False), PutPlan)

        async def send() -> None:
            for i, ref in enumerate(plan.segments):
                if ref is not None:
                    await _send(self.caller, self.address, PutData(put_id=plan.put_id, index=i, offset=0),
                                memoryview(self.inputs[i].data), self.ctx)  # type: ignore[arg-type]

        return await self._finish(plan, send)

    async def _finish(self, plan: PutPlan, transfer: Callable[[], Awaitable[None]]) -> ArtifactInfo:
        """Hand the bytes over (unless the worker holds them all), then commit; abort on any failure."""
        try:
            if not plan.exists:
                await transfer()
            done = await self._call(PutCommit(put_id=plan.put_id), PutDone)
        except BaseException:
            await _abort(self.caller, plan.put_id, self.address)
            raise
        return done.artifact


async def _send(caller: Caller, address: str, msg: PutData, data: memoryview, ctx: CallContext) -> None:
    """One tensor's bytes as a checksummed payload; sent again (same offset) while chunks arrive corrupted."""
    for attempt in range(PUT_DATA_ATTEMPTS):
        try:
            await caller.call(msg, Ack, ctx, address=address, payload=data)
            return
        except ChunkCorrupted:
            if attempt == PUT_DATA_ATTEMPTS - 1:
                raise


async def _abort(caller: Caller, put_id: str, address: str) -> None:
    # Best effort: the worker reclaims abandoned puts after worker.put_timeout anyway.
    with contextlib.suppress(TensorCastError, asyncio.CancelledError):
        await caller.call(PutAbort(put_id=put_id), Ack, CallContext().with_timeout(5.0), address=address)


async def _hash(inputs: list[TensorInput]) -> None:
    """Compute the digests not computed yet (on a thread unless there are few bytes to hash)."""
    if sum(t.nbytes for t in inputs if not t.digest) < _INLINE_WRITE_BYTES:
        _hash_all(inputs)
    else:
        await asyncio.to_thread(_hash_all, inputs)


def _hash_all(inputs: list[TensorInput]) -> None:
    for t in inputs:
        if not t.digest:
            t.digest = digest_bytes(t.data)


async def _write(writer: SegmentWriter, plan: PutPlan, inputs: list[TensorInput]) -> None:
    """Same host: write the bytes into the targets; on a thread unless they are few (a thread hop costs more)."""
    if sum(ref.size for ref in plan.segments if ref is not None) < _INLINE_WRITE_BYTES:
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
