"""Content trust on a worker: no blob is deduplicated onto or handed out before its bytes match its digest.

Storage is content-addressed, and a same-host caller writes its bytes into this worker's memory (or disk
files) itself and states their digest (``worker.verify_local_puts`` off, the default: hashing every such put
here would cost more than the copy). Such a blob is *unverified* (``MemoryTier``/``DiskTier`` keep the
set); every other blob was hashed here or pulled from a peer that checked it before sending. An unverified
blob is checked once (BLAKE3 on a thread), at the first of: a put or a fetch that would deduplicate onto it
(``ensure``; ``settle`` right before a commit stores blobs), a read that would be served from it (``MapTensors``,
a data-plane send, a device copy), or an idle moment (``verify_idle``, bounded, at low priority). A blob
whose bytes do not match is condemned: dropped with every replica using it, as an eviction, its pages
never reused for other bytes, and the next upload of that digest is stored afresh; a warning is logged and
``tensorcast_blob_verifications_total{result="mismatch"}`` counts it.

Owns: those checks and condemnations. Does not own: the trust sets themselves (``pool.memory``,
``pool.disk``), or where the put and fetch protocols call in (``worker.puts``, ``worker.fetch``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable

import blake3

from tensorcast.errors import NotFound, Unavailable
from tensorcast.obs import metrics
from tensorcast.tensors import digest_bytes
from tensorcast.wire.messages import DataRequest
from tensorcast.worker.store import LocalStore

__all__ = ["BlobTrust"]

log = logging.getLogger("tensorcast.worker")
# Fewer unverified bytes than this are checked on the event loop (a thread hop costs about as much).
_INLINE_CHECK_BYTES = 256 * 1024
# A commit re-checks at most this many times for blobs stored meanwhile (by racing puts) before it gives up.
_SETTLE_PASSES = 4

Blob = tuple[str, str]  # (tier, digest)


class BlobTrust:
    def __init__(self, store: LocalStore) -> None:
        self.store = store
        self._guard = threading.Lock()
        self._locks: dict[Blob, threading.Lock] = {}  # one check of a blob at a time, across threads
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        if store.disk is not None:
            disk_replaced = store.disk.replaced

            def replaced(digest: str) -> None:  # a storing thread replaced a held blob that failed its check
                disk_replaced(digest)
                metrics.blob_verified("dedup", False)
                _mismatch("disk", digest, "dedup", "replaced by the new upload")

            store.disk.replaced = replaced

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    # ----------------------------------------------------------------- queries
    def _unchecked(self, digests: Iterable[str], tiers: tuple[str, ...] = ("memory", "disk")) -> list[Blob]:
        """The held blobs among ``digests`` whose bytes were never checked, in the tiers asked."""
        memory, disk = self.store.memory, self.store.disk
        out: list[Blob] = []
        if not self._any():
            return out
        for d in dict.fromkeys(digests):
            if "memory" in tiers and memory.is_unverified(d):
                out.append(("memory", d))
            if "disk" in tiers and disk is not None and disk.is_unverified(d):
                out.append(("disk", d))
        return out

    def _read_blobs(self, artifact_id: str, names: Iterable[str], tier: str) -> list[Blob]:
        """The unchecked blobs a read of these tensors would be served from (memory first, then disk)."""
        memory, disk = self.store.memory, self.store.disk
        out: list[Blob] = []
        if not self._any():
            return out
        metas = {t.name: t for t in self.store.tensors(artifact_id)}
        for name in names:
            meta = metas.get(name)
            if meta is None:
                continue  # unknown: the read itself says so
            d = meta.digest
            if tier in ("", "memory") and memory.has_blob(d):
                if memory.is_unverified(d):
                    out.append(("memory", d))
            elif tier in ("", "disk") and disk is not None and disk.is_unverified(d):
                out.append(("disk", d))
        return out

    def _any(self) -> bool:
        """Anything unchecked here at all (most of the time, on a worker without same-host writers: no)."""
        disk = self.store.disk
        return self.store.memory.any_unverified or (disk is not None and disk.any_unverified)

    def _inline(self, blobs: list[Blob]) -> bool:
        """Few bytes, all in memory: checked on the loop (a disk check reads a file: always on a thread)."""
        sizes = self.store.memory.state.blob_size
        return all(t == "memory" for t, _ in blobs) and sum(sizes.get(d, 0) for _, d in blobs) < _INLINE_CHECK_BYTES

    def unchecked_read(self, artifact_id: str, names: Iterable[str]) -> bool:
        """Whether a memory read of these tensors would be served from a blob not checked yet."""
        return bool(self._read_blobs(artifact_id, names, "memory"))

    # ----------------------------------------------------------------- checks (any thread)
    def check(self, blob: Blob, reason: str, threads: int = blake3.blake3.AUTO) -> bool:
        """Check one blob's bytes against its digest, once (a match is remembered; one gone counts as fine:
        nothing is served from it). False: a mismatch, to condemn. Blocking."""
        with self._guard:
            lock = self._locks.setdefault(blob, threading.Lock())
        with lock:
            try:
                ok = self._check(blob, threads)
            finally:
                with self._guard:
                    self._locks.pop(blob, None)
        if ok is not None:
            metrics.blob_verified(reason, ok)
        return ok is not False

    def _check(self, blob: Blob, threads: int) -> bool | None:
        tier, digest = blob
        if tier == "disk":
            assert self.store.disk is not None
            return self.store.disk.check(digest, threads)
        memory = self.store.memory
        if not memory.is_unverified(digest):
            return None  # checked meanwhile (or gone)
        try:
            loc, release = memory.lease(digest)
        except NotFound:
            return None
        try:
            ok = _digest(loc.view(), threads) == digest
        finally:
            release()
        if ok:
            memory.mark_verified(digest)
        return ok

    def check_read(self, req: DataRequest) -> None:
        """(A data-plane thread.) Before a send: the blob it reads from is checked; one that fails is condemned
        and the read refused (``NotFound``: the reader tries another replica)."""
        for blob in self._read_blobs(req.artifact_id, (req.name,), req.tier):
            if not self.check(blob, "read"):
                if self._loop is not None:
                    self._loop.call_soon_threadsafe(self._condemn_soon, blob)
                raise NotFound(f"blob {blob[1][:16]} failed its digest check on this worker")

    # ----------------------------------------------------------------- on the event loop
    async def ensure(self, digests: Iterable[str], reason: str = "dedup") -> int:
        """Check the held, unchecked blobs among ``digests`` (both tiers); condemn those that fail. Returns how
        many were condemned. Returns at once, without yielding to the loop, when there is nothing to check."""
        return await self._check_all(self._unchecked(digests), reason)

    async def ensure_read(self, artifact_id: str, names: Iterable[str], tier: str) -> None:
        """Before handing tensors out (mapped, or copied to a device): check the blobs they come from."""
        await self._check_all(self._read_blobs(artifact_id, names, tier), "read")

    async def settle(self, digests: Iterable[str]) -> None:
        """``ensure`` until nothing held among ``digests`` is unchecked (puts racing with this one may store
        some meanwhile); when it returns, the caller may deduplicate onto any of them before it next awaits."""
        digests = list(digests)
        for _ in range(_SETTLE_PASSES):
            todo = self._unchecked(digests)
            if not todo:
                return
            await self._check_all(todo, "dedup")
        raise Unavailable("blobs of this put kept changing while it committed; retry it")

    async def _check_all(self, blobs: list[Blob], reason: str) -> int:
        if not blobs:
            return 0
        if self._inline(blobs):
            bad = [b for b in blobs if not self.check(b, reason)]
        else:
            bad = await asyncio.to_thread(lambda: [b for b in blobs if not self.check(b, reason)])
        for blob in bad:
            await self.condemn(blob, reason)
        return len(bad)

    async def condemn(self, blob: Blob, reason: str) -> None:
        """Drop a blob whose bytes are not its digest's, with the replicas using it (the global store told)."""
        tier, digest = blob
        store = self.store
        if tier == "memory":
            users = store.memory.condemn(digest)
        else:
            assert store.disk is not None
            users = store.disk.condemn(digest)
            store.close_disk_segments()
        store.forget_checksums(digest)
        _mismatch(tier, digest, reason, f"dropped with the replicas of {users}" if users else "dropped")
        for aid in users:
            await store.report_gone(aid, tier)

    def _condemn_soon(self, blob: Blob) -> None:
        task = asyncio.ensure_future(self.condemn(blob, "read"))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ----------------------------------------------------------------- idle
    def verify_idle(self, budget: int, busy: Callable[[], bool]) -> list[Blob]:
        """(The background thread.) Check unchecked blobs, memory first, one core, up to ``budget`` bytes,
        stopping as soon as ``busy()``; returns those that failed (condemn them on the loop)."""
        bad: list[Blob] = []
        blobs = [("memory", d, n) for d, n in self.store.memory.unverified_blobs()]
        if self.store.disk is not None:
            blobs += [("disk", d, n) for d, n in self.store.disk.unverified_blobs()]
        for tier, digest, nbytes in blobs:
            if budget <= 0 or busy():
                break
            budget -= nbytes
            if not self.check((tier, digest), "idle", threads=1):
                bad.append((tier, digest))
        return bad


def _digest(view: memoryview, threads: int) -> str:
    return digest_bytes(view) if threads != 1 else str(blake3.blake3(view).hexdigest())


def _mismatch(tier: str, digest: str, reason: str, what: str) -> None:
    log.warning("%s blob %s does not match its digest (bytes written by a same-host caller that stated another "
                "digest, or changed while it was put); %s", tier, digest[:16], what)
