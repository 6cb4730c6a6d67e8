"""The put protocol from the caller's side: begin, hand the bytes over, commit (or abort).

Owns: ``PutBegin`` -> bytes -> ``PutCommit`` against the worker that takes the first replica. Same host:
one copy of each tensor straight into the shared-memory segment the worker reserved. Another host (or a
``/dev/shm`` this process cannot see): ``PutData`` payloads that the worker receives straight into the
segment, each checked against its chunk checksums and sent again if a chunk arrived corrupted. A failed
put is aborted (the worker also reclaims abandoned ones). Does not own: normalizing inputs (``tensors``)
or the artifact handle (``client.aio``).
"""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np

from tensorcast.checksums import ChunkCorrupted
from tensorcast.client.locality import Locality
from tensorcast.context import CallContext
from tensorcast.errors import TensorCastError
from tensorcast.pool.segments import SegmentGone, map_shared
from tensorcast.records import ArtifactInfo, Placement
from tensorcast.tensors import TensorInput
from tensorcast.wire.caller import Caller
from tensorcast.wire.messages import Ack, PutAbort, PutBegin, PutCommit, PutData, PutDone, PutPlan

__all__ = ["PUT_DATA_ATTEMPTS", "put_tensors"]

# Sends of one tensor's bytes whose chunks arrived corrupted before the put fails (ChunkCorrupted).
PUT_DATA_ATTEMPTS = 3


async def put_tensors(caller: Caller, locality: Locality, address: str, inputs: list[TensorInput], *,
                      key: str | None, ttl: float | None, policy: str | Placement | None,
                      ctx: CallContext) -> ArtifactInfo:
    """Store ``inputs`` as one artifact on the worker at ``address``; returns its committed record."""
    welcome = await caller.connect(address)
    metas = tuple(t.meta for t in inputs)

    def begin(same_host: bool) -> PutBegin:
        return PutBegin(tensors=metas, key=key, ttl=ttl, same_host=same_host, placement=policy)

    plan = await caller.call(begin(locality.same_host(welcome.host_id)), PutPlan, ctx, address=address)
    try:
        if not plan.exists and not plan.stream:
            try:
                await asyncio.to_thread(_write_segments, plan, inputs)
            except SegmentGone:
                # Same host id, but /dev/shm is not shared (another container): stream instead.
                locality.shared_memory_unreachable()
                await caller.call(PutAbort(put_id=plan.put_id), Ack, ctx, address=address)
                plan = await caller.call(begin(False), PutPlan, ctx, address=address)
        if not plan.exists and plan.stream:
            for i, ref in enumerate(plan.segments):
                if ref is not None:
                    await _send(caller, address, PutData(put_id=plan.put_id, index=i, offset=0),
                                memoryview(inputs[i].data), ctx)  # type: ignore[arg-type]
        done = await caller.call(PutCommit(put_id=plan.put_id), PutDone, ctx, address=address)
    except BaseException:
        await _abort(caller, plan.put_id, address)
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


def _write_segments(plan: PutPlan, inputs: list[TensorInput]) -> None:
    """Same host: copy each tensor's bytes once, straight into the segment the worker reserved."""
    for ref, item in zip(plan.segments, inputs, strict=True):
        if ref is None:
            continue
        mm = map_shared(ref.path, ref.offset + ref.size)
        try:
            dst = np.frombuffer(mm, dtype=np.uint8, count=ref.size, offset=ref.offset)
            np.copyto(dst, item.data)
            del dst
        finally:
            mm.close()
