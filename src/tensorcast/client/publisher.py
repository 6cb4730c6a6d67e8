"""Publishing weight versions (a trainer's side of weight sync), and finding them (anyone's side).

Owns: ``AsyncWeightPublisher`` — ``publish(state_dict, version=None)`` puts one version as one artifact under
``{model}@v{N}`` (N: one past the newest when not given), then collects old versions: all but the newest
``keep_last`` and those some binding uses (its caller-leased use record, ``{model}@use/v{N}/{holder}``) are
deleted, by key (content another key still names stays). Tensors unchanged since an earlier version cost no
copy: the pool is content-addressed per tensor, and the publisher knows every tensor's digest before the put
begins, so that the worker that takes it skips each tensor whose digest it already holds (only changed tensors
are copied, or sent from another host). A digest costs a BLAKE3 pass over the bytes; a tensor whose chunks'
XXH3-128 (about three times cheaper, ``weights.delta``) all equal those it had at this publisher's previous
publish keeps that publish's digest, and one the caller names as unchanged costs nothing. The same one pass
finds which chunks of a changed tensor changed: a version published after another (same tensors, at most half
the bytes changed) carries a delta record (``weights.versions.DELTA_TENSOR``) that lets a reader holding the
previous version read only those chunks. Also the listing every party shares: the versions of a model, the
versions in use, and ``wait_newer`` (polling with a bounded backoff: 50 ms doubling to 1 s, up to the timeout).
Does not own: the put protocol (``client.puts``), bindings (``client.binding``), the GC decision
(``weights.versions``), chunking and delta records (``weights.delta``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from tensorcast.client.locality import Locality
from tensorcast.client.puts import put_tensors
from tensorcast.client.reads import Reader
from tensorcast.client.write_maps import SegmentWriter
from tensorcast.config import Config, WeightsConfig
from tensorcast.context import CallContext
from tensorcast.errors import InvalidArgument, NotFound, clip
from tensorcast.records import ArtifactInfo, Placement, WorkerInfo
from tensorcast.tensors import TensorInput, normalize_tensors
from tensorcast.weights.delta import Chunking, Delta, TensorChunks, chunk_digests, chunking, delta_between
from tensorcast.weights.versions import (
    DELTA_TENSOR,
    META_TENSORS,
    VERSION_TENSOR,
    Backoff,
    check_model,
    gc_decision,
    next_version,
    parse_version_key,
    use_prefix,
    version_key,
    version_prefix,
    version_tag,
    versions_in_use,
)
from tensorcast.wire.caller import Caller
from tensorcast.wire.connection import ConnectionLost, NotSent
from tensorcast.wire.messages import DeleteArtifact, ListArtifacts

__all__ = ["AsyncWeightPublisher", "ClientPort", "Published", "list_keys", "list_versions", "wait_newer"]

_PAGE = 1000
# The unchanged-tensor check (XXH3-128 of every tensor) runs on several threads above this many bytes.
_PARALLEL_CHECK_BYTES = 32 << 20
_CHECK_THREADS = max(1, min(4, os.cpu_count() or 1))


class ClientPort(Protocol):
    """What weight sync uses of an ``AsyncClient`` (named here, not imported: the client imports us)."""

    caller: Caller
    reader: Reader
    locality: Locality
    writer: SegmentWriter
    host_id: str
    config: Config

    async def put(self, tensors: Any, key: str | None = None, *, ttl: float | None = None,
                  policy: str | Placement | None = None, on: str | None = None, timeout: float | None = None,
                  ctx: CallContext | None = None) -> Any: ...

    async def list_workers(self) -> list[WorkerInfo]: ...


@dataclass(frozen=True)
class Published:
    """One published version: its number, key and artifact, what it changed, what GC deleted."""

    version: int
    key: str
    artifact_id: str
    nbytes: int
    changed_tensors: int  # tensors whose content no existing version had
    changed_bytes: int  # their distinct bytes: what the put copied or sent (the rest was deduplicated), plus
    # the version tag's few bytes (``weights.versions.VERSION_TENSOR``), not counted here
    deleted: tuple[int, ...] = ()
    seconds: float = 0.0
    delta_base: int | None = None  # the version this one carries a delta from (None: no delta record)
    delta_bytes: int = 0  # the bytes of the changed chunks: what a reader holding delta_base reads (else all)


async def list_keys(caller: Caller, prefix: str, ctx: CallContext | None = None) -> dict[str, ArtifactInfo]:
    """``{key: artifact}`` for every key under ``prefix``, paged through."""
    out: dict[str, ArtifactInfo] = {}
    after = ""
    while True:
        reply = await caller.call(ListArtifacts(prefix=prefix, limit=_PAGE, after=after), ctx)
        out.update({k: info for info, k in zip(reply.artifacts, reply.entry_keys, strict=True) if k})
        if not reply.next:
            return out
        after = reply.next


async def list_versions(caller: Caller, model: str, ctx: CallContext | None = None) -> dict[int, ArtifactInfo]:
    """``{version: artifact}`` of every published version of ``model`` that still exists."""
    found = await list_keys(caller, version_prefix(model), ctx)
    return dict(sorted((n, info) for k, info in found.items() if (n := parse_version_key(model, k)) is not None))


async def list_in_use(caller: Caller, model: str, ctx: CallContext | None = None) -> dict[int, tuple[str, ...]]:
    """``{version: holders}``: the versions live bindings hold (their use records' leases are unexpired)."""
    return versions_in_use(model, await list_keys(caller, use_prefix(model), ctx))


_BACKOFF = Backoff()


async def wait_newer(caller: Caller, model: str, than: int | None, timeout: float | None,
                     backoff: Backoff = _BACKOFF) -> int | None:
    """The newest version above ``than`` (any, when None) once one exists; None after ``timeout`` seconds."""
    deadline = None if timeout is None else time.time() + timeout
    attempt = 0
    while True:
        found = await list_versions(caller, model)
        newest = max(found, default=None)
        if newest is not None and (than is None or newest > than):
            return newest
        now = time.time()
        if deadline is not None and now >= deadline:
            return None
        await asyncio.sleep(backoff.delay(attempt, now, deadline))
        attempt += 1


def _chunk_digests_all(tensors: list[tuple[Any, Chunking]]) -> list[bytes]:
    """Each tensor's chunk digests (``weights.delta.chunk_digests``), on several threads when there are many
    bytes (xxhash releases the GIL; one thread reads ~8-12 GB/s here, two ~19 GB/s), largest first so that the
    threads finish together."""
    if sum(data.nbytes for data, _ in tensors) < _PARALLEL_CHECK_BYTES or len(tensors) < 2:
        return [chunk_digests(data, cut) for data, cut in tensors]
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i][0].nbytes)
    out = [b""] * len(tensors)
    with concurrent.futures.ThreadPoolExecutor(min(_CHECK_THREADS, len(tensors))) as pool:
        for i, digests in zip(order, pool.map(lambda i: chunk_digests(*tensors[i]), order), strict=True):
            out[i] = digests
    return out


class AsyncWeightPublisher:
    """Publishes versions of one model (``client.publisher(model, keep_last=2, policy=...)``)."""

    def __init__(self, client: ClientPort, model: str, *, keep_last: int = 2, policy: str | Placement | None = None,
                 on: str | None = None) -> None:
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise InvalidArgument(f"keep_last must be an integer >= 1, got {clip(keep_last)}")
        self.client = client
        self.model = check_model(model)
        self.keep_last = keep_last
        self.policy = policy
        self.on = on
        self.last: Published | None = None
        config = getattr(client, "config", None)
        self.chunk_bytes = (config.weights if config is not None else WeightsConfig()).delta_chunk_bytes
        # Per tensor name, what the previous publish (version _seen_version) stored: its chunks, BLAKE3 digest.
        self._seen: dict[str, tuple[TensorChunks, str]] = {}
        self._seen_version: int | None = None

    async def publish(self, state_dict: Mapping[str, Any], version: int | None = None, *,
                      changed: Collection[str] | None = None, timeout: float | None = None) -> Published:
        """Put ``state_dict`` as version ``version`` (default: one past the newest) under ``{model}@v{N}``,
        then delete versions beyond ``keep_last`` that no binding uses. Unchanged tensors are not copied.

        ``changed``: the names of the tensors that changed since this publisher's previous publish, when the
        caller knows them (e.g. only some layers were trained). The others are taken as holding the bytes
        they held then, and are not read at all; a tensor left out that did change would be published with
        its old content. Without it, each tensor is checked (XXH3-128 against the previous publish)."""
        if not isinstance(state_dict, Mapping) or not state_dict:
            raise InvalidArgument("publish takes a non-empty {name: tensor} mapping")
        if META_TENSORS & state_dict.keys():
            raise InvalidArgument(f"tensor names {sorted(META_TENSORS)} are reserved (the version's tag and delta)")
        if changed is not None:
            changed = set(changed)
            unknown = changed - set(state_dict)
            if unknown:
                raise InvalidArgument(f"changed names tensors the state dict lacks: {clip(sorted(unknown))}")
        t0 = time.perf_counter()
        ctx = self.client.caller.context(timeout)
        existing = await list_versions(self.client.caller, self.model, ctx)
        n = next_version(existing) if version is None else version
        if n in existing:
            raise InvalidArgument(f"version {n} of {self.model} exists already (versions are immutable)")
        key = version_key(self.model, n)
        info, delta = await self._put({**state_dict, VERSION_TENSOR: version_tag(self.model, n)}, key, n, ctx,
                                      changed)
        known = {t.digest for v in existing.values() for t in v.tensors}
        mine = [t for t in info.tensors if t.name not in META_TENSORS]  # the tag's and record's bytes not counted
        changed = {t.digest: t.nbytes for t in mine if t.digest not in known}
        deleted = await self._collect({**existing, n: info}, ctx)
        layout = {t.name: (t.shape, t.nbytes) for t in mine}
        self.last = Published(version=n, key=key, artifact_id=info.id, nbytes=info.nbytes,
                              changed_tensors=sum(1 for t in mine if t.digest in changed),
                              changed_bytes=sum(changed.values()), deleted=tuple(deleted),
                              seconds=time.perf_counter() - t0, delta_base=None if delta is None else delta.base,
                              delta_bytes=sum(t.nbytes for t in mine) if delta is None else delta.nbytes(layout))
        return self.last

    async def _put(self, tensors: Mapping[str, Any], key: str, version: int, ctx: CallContext,
                   changed: Collection[str] | None) -> tuple[ArtifactInfo, Delta | None]:
        """Put with the digests of the tensors unchanged since the previous publish stated first, so that the
        worker skips them before any byte is copied; the changed ones (new bytes: nothing to skip) are hashed
        while they are written (``PutBegin.digests_later``), and the delta from the previous publish rides
        along. Through another gateway if this one goes away, like ``AsyncClient.put``. Remembers each
        tensor's checksums once the version is stored."""
        inputs = await asyncio.to_thread(normalize_tensors, tensors)
        seen, seen_version = self._seen, self._seen_version  # one snapshot, should publishes overlap
        chunks = await asyncio.to_thread(self._reuse_digests, inputs, changed, seen)
        delta = None if seen_version is None else delta_between(
            seen_version, {n: s[0] for n, s in seen.items()},  # the tag is not remembered
            {n: c for n, c in chunks.items() if n != VERSION_TENSOR})
        if delta is not None:  # in name order, like every put's tensors (the worker's segments follow it)
            inputs = sorted(inputs + normalize_tensors({DELTA_TENSOR: delta.encode()}), key=lambda t: t.name)
        caller = self.client.caller
        while True:
            address = caller.address
            if self.on is not None:
                workers = {w.worker_id: w for w in await self.client.list_workers()}
                if self.on not in workers:
                    raise NotFound(f"no worker {clip(self.on)}")
                address = workers[self.on].address
            try:
                info = await put_tensors(caller, self.client.locality, self.client.writer, address, inputs,
                                         key=key, ttl=None, policy=self.policy, ctx=ctx)
            except (NotSent, ConnectionLost):
                if self.on is not None or not caller.fail_over(address):
                    raise
                continue
            self._remember(inputs, chunks, {t.name: t.digest for t in info.tensors}, version)
            return info, delta

    def _remember(self, inputs: list[TensorInput], chunks: Mapping[str, TensorChunks], stored: Mapping[str, str],
                  version: int = 0) -> None:
        """What the next publish compares against: each tensor's chunks and stored BLAKE3 digest."""
        self._seen = {t.name: (chunks[t.name], stored[t.name]) for t in inputs if t.name not in META_TENSORS}
        self._seen_version = version or None

    def _reuse_digests(self, inputs: list[TensorInput], changed: Collection[str] | None,
                       seen: Mapping[str, tuple[TensorChunks, str]] | None = None) -> dict[str, TensorChunks]:
        """Give the inputs whose bytes are the previous publish's (``changed`` leaves them out, or their
        chunks' XXH3-128 are unchanged) that publish's BLAKE3 digest; the others keep none (the put computes
        it). Returns every input's chunks (those ``changed`` leaves out: as they were, not read). ``seen``: what
        the previous publish stored (default: this publisher's, now)."""
        seen = self._seen if seen is None else seen
        same = {t.name: b for t in inputs if (b := seen.get(t.name)) is not None and b[0][:2] == (t.dtype, t.shape)}
        check = [t for t in inputs if t.name not in same or changed is None or t.name in changed]
        cuts = [chunking(t.shape, t.nbytes, self.chunk_bytes) for t in check]
        digests = _chunk_digests_all([(t.data, cut) for t, cut in zip(check, cuts, strict=True)])
        out = {t.name: (t.dtype, t.shape, cut, d) for t, cut, d in zip(check, cuts, digests, strict=True)}
        for t in inputs:
            before = same.get(t.name)
            if before is not None:
                now = out.setdefault(t.name, before[0])
                if now[2:] == before[0][2:]:
                    t.digest = before[1]
        return out

    async def _collect(self, versions: Mapping[int, ArtifactInfo], ctx: CallContext | None) -> list[int]:
        in_use = await list_in_use(self.client.caller, self.model, ctx)
        doomed = gc_decision(versions, in_use, self.keep_last)
        for n in doomed:
            # By key: a version's bytes go only when no other key (another version or model, a user's alias)
            # or lease still refers to them.
            with contextlib.suppress(NotFound):  # deleted meanwhile (another publisher's GC)
                await self.client.caller.call(DeleteArtifact(key_or_id=version_key(self.model, n)), ctx)
        return doomed

    async def gc(self, *, timeout: float | None = None) -> tuple[int, ...]:
        """Delete the versions beyond ``keep_last`` that no binding uses now; returns their numbers."""
        ctx = self.client.caller.context(timeout)
        return tuple(await self._collect(await list_versions(self.client.caller, self.model, ctx), ctx))

    async def versions(self) -> list[int]:
        """The versions of this model that exist, oldest first."""
        return list(await list_versions(self.client.caller, self.model))

    async def latest(self) -> int | None:
        return max(await list_versions(self.client.caller, self.model), default=None)

    async def in_use(self) -> dict[int, tuple[str, ...]]:
        """``{version: holders}``: the versions bindings hold (kept by GC while they do)."""
        return await list_in_use(self.client.caller, self.model)

    async def wait_newer(self, than: int | None = None, timeout: float | None = None) -> int | None:
        """Block until a version newer than ``than`` exists (any version, when None) and return the newest;
        None after ``timeout`` seconds. Polls with a bounded backoff (50 ms doubling to 1 s)."""
        return await wait_newer(self.client.caller, self.model, than, timeout)
