"""``RegionBackedArtifactSession``: a process's byte-artifact session on a TensorCast cluster's KV pages.

This is the ``tensorcast.api.store`` module that SGLang's bundled ``tensorcast`` HiCache backend imports.
A session attaches to a gateway (``daemon_address``), owns the host regions it allocates
(``allocate_host_tensor``) and answers three batched calls, each artifact one KV page (``kv_key``):

- ``batch_exists(specs)``: an exact existence mask (not a prefix count);
- ``batch_put_from(transfers)``: store each span's bytes; ``batch_get_into(transfers)``: fill each span.

Transfer modes. *Allocator*: spans must lie in regions of this session and are read and written in place
(a same-host put copies them straight into the shard home's slots; a get lands straight in the span).
*Scratch*: spans may be any host memory; a batch is staged through one arena per direction of
``capacity_bytes`` (a batch that does not fit is an input error), so a get writes only whole pages into
the caller's memory, never a partly received one.

Errors. Malformed input raises ``RegionArtifactInputError`` and leaves the session usable. Passing cluster
trouble (a shard between homes, a slow or restarting home: the retryable TensorCast errors) makes the
affected items misses or failed puts, never an exception, since a cache can always recompute. Anything
else (refused token, internal error, no gateway at attach) fails the session for good:
``RegionSessionFailedError`` now and on every later call. After ``terminate_process_session`` every call
raises ``RegionSessionTerminatedError``; allocated regions stay valid while their tensors are referenced.

Owns: the session lifecycle, the region table, staging, and mapping results and errors. Does not own: the
value types (``tensorcast.api.byte_artifacts``) or how pages are located and moved (``client.kv``).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, NoReturn

import numpy as np

from tensorcast.api.byte_artifacts import (
    AllocatorTransferOptions,
    ByteArtifactKeyspace,
    ByteArtifactSpec,
    HostMemorySpan,
    RegionArtifactExistsResult,
    RegionArtifactInputError,
    RegionArtifactTransfer,
    RegionArtifactTransferResult,
    RegionBackedArtifactSessionOptions,
    RegionSessionFailedError,
    RegionSessionFailure,
    RegionSessionFailureCode,
    RegionSessionOperationKind,
    RegionSessionTerminatedError,
    ScratchTransferOptions,
)
from tensorcast.client.aio import AsyncClient
from tensorcast.client.aio import connect as aio_connect
from tensorcast.client.loop import LoopThread
from tensorcast.config import Config
from tensorcast.errors import DeadlineExceeded, InvalidArgument, TensorCastError, Unauthenticated

__all__ = [
    "AllocatorTransferOptions",
    "ByteArtifactKeyspace",
    "ByteArtifactSpec",
    "HostMemorySpan",
    "RegionArtifactExistsResult",
    "RegionArtifactInputError",
    "RegionArtifactTransfer",
    "RegionArtifactTransferResult",
    "RegionBackedArtifactSession",
    "RegionBackedArtifactSessionOptions",
    "RegionSessionFailedError",
    "RegionSessionFailure",
    "RegionSessionFailureCode",
    "RegionSessionOperationKind",
    "RegionSessionTerminatedError",
    "ScratchTransferOptions",
]

_Kind = RegionSessionOperationKind


def _failure(kind: RegionSessionOperationKind, exc: BaseException, operation_id: str | None) -> RegionSessionFailure:
    if isinstance(exc, DeadlineExceeded | TimeoutError):
        code = RegionSessionFailureCode.TIMEOUT
    elif isinstance(exc, Unauthenticated):
        code = RegionSessionFailureCode.UNAUTHENTICATED
    elif (isinstance(exc, TensorCastError) and exc.retryable) or isinstance(exc, OSError):
        code = RegionSessionFailureCode.TRANSPORT
    else:
        code = RegionSessionFailureCode.INTERNAL
    return RegionSessionFailure(code=code, message=str(exc) or type(exc).__name__, operation_kind=kind,
                                operation_id=operation_id, occurred_at=datetime.now(UTC))


class _Region:
    """One host tensor this session allocated: its name and the bytes it spans."""

    def __init__(self, name: str, tensor: Any) -> None:
        self.name = name
        self.tensor = tensor
        self.start = int(tensor.data_ptr())
        self.end = self.start + int(tensor.numel() * tensor.element_size())


async def _exists_mask(client: AsyncClient, keys: list[str]) -> list[bool]:
    """Exact per-key existence: one batched ``kv.present`` (per-key flags, no prefix semantics)."""
    return await client.kv.present(keys)


class RegionBackedArtifactSession:
    """A process-scoped byte-artifact session. Build with ``attach``; end with ``terminate_process_session``.
    Thread-safe: calls from several threads share one client on the session's event-loop thread."""

    def __init__(self, options: RegionBackedArtifactSessionOptions, client: AsyncClient, loop: LoopThread) -> None:
        self.options = options
        self.client = client
        self.loop = loop
        self.lock = threading.Lock()
        self.regions: list[_Region] = []
        self.failure: RegionSessionFailure | None = None
        self.terminated = False
        self.stats: dict[str, int] = dict.fromkeys(
            ("exists_calls", "exists_hits", "puts", "put_bytes", "gets", "get_hits", "get_bytes", "transient_errors"),
            0)
        self._names = itertools.count(1)
        self._arenas: dict[str, np.ndarray[Any, Any]] = {}
        self._arena_locks = {"get": threading.Lock(), "put": threading.Lock()}

    @classmethod
    def attach(cls, options: RegionBackedArtifactSessionOptions) -> RegionBackedArtifactSession:
        """Connect to the cluster at ``options.daemon_address``; ``RegionSessionFailedError`` if it cannot."""
        if type(options) is not RegionBackedArtifactSessionOptions:
            raise RegionArtifactInputError(f"attach needs RegionBackedArtifactSessionOptions, got {type(options)}")
        overrides: dict[str, Any] = {}
        if options.transfer_timeout_s is not None:
            overrides["kv.request_timeout"] = options.transfer_timeout_s
        loop = LoopThread(f"tensorcast-session-{options.session_name}")
        try:
            client = loop.run(aio_connect(options.daemon_address, options.token,
                                          config=Config.load(overrides=overrides)))
        except (TensorCastError, OSError) as exc:
            loop.stop()
            raise RegionSessionFailedError(_failure(_Kind.ATTACH, exc, None)) from exc
        return cls(options, client, loop)

    # ----------------------------------------------------------------- state
    def _check_usable(self) -> None:
        with self.lock:
            if self.terminated:
                raise RegionSessionTerminatedError(f"session {self.options.session_name} was terminated")
            if self.failure is not None:
                raise RegionSessionFailedError(self.failure)

    def _fail(self, kind: RegionSessionOperationKind, exc: BaseException, operation_id: str | None) -> NoReturn:
        with self.lock:
            if self.failure is None:
                self.failure = _failure(kind, exc, operation_id)
            failure = self.failure
        raise RegionSessionFailedError(failure) from exc

    def _call(self, kind: RegionSessionOperationKind, coro: Any, operation_id: str | None) -> Any:
        """Run ``coro`` on the session's loop. Input errors pass through as ``RegionArtifactInputError``;
        retryable cluster errors return None (the caller reports misses); the rest fail the session."""
        try:
            return self.loop.run(coro)
        except InvalidArgument as exc:
            raise RegionArtifactInputError(exc.message) from exc
        except (TensorCastError, TimeoutError) as exc:
            if isinstance(exc, TimeoutError) or exc.retryable:
                with self.lock:
                    self.stats["transient_errors"] += 1
                return None
            self._fail(kind, exc, operation_id)
        except (OSError, RuntimeError) as exc:  # the loop or the connection itself broke
            self._fail(kind, exc, operation_id)

    def _count(self, **deltas: int) -> None:
        with self.lock:
            for name, delta in deltas.items():
                self.stats[name] += delta

    # ----------------------------------------------------------------- regions
    def allocate_host_tensor(self, shape: Sequence[int], dtype: Any, *, name: str) -> Any:
        """A zeroed CPU torch tensor registered as a region of this session (allocator mode moves spans
        of it in place). The region's name is made unique per process: ``prefix-pid-seq-name``."""
        import torch

        self._check_usable()
        if not name or type(name) is not str:
            raise RegionArtifactInputError("a region needs a non-empty name")
        dims = tuple(int(d) for d in shape)
        if any(d < 0 for d in dims):
            raise RegionArtifactInputError(f"invalid shape {dims}")
        tensor = torch.zeros(dims, dtype=dtype)
        region = _Region(f"{self.options.region_name_prefix}-{os.getpid()}-{next(self._names)}-{name}", tensor)
        with self.lock:
            self.regions.append(region)
        return tensor

    def region_of(self, span: HostMemorySpan) -> str | None:
        """The name of this session's region that holds all of ``span``, if any."""
        end = span.address + span.byte_length
        with self.lock:
            return next((r.name for r in self.regions if r.start <= span.address and end <= r.end), None)

    # ----------------------------------------------------------------- operations
    def batch_exists(self, specs: Sequence[ByteArtifactSpec]) -> RegionArtifactExistsResult:
        self._check_usable()
        if any(type(s) is not ByteArtifactSpec for s in specs):
            raise RegionArtifactInputError("batch_exists takes ByteArtifactSpec items")
        if not specs:
            return RegionArtifactExistsResult(existence_mask=(), rpc_elapsed_s=0.0)
        keys = [s.kv_key for s in specs]
        t0 = time.perf_counter()
        mask = self._call(_Kind.EXISTS, asyncio.wait_for(_exists_mask(self.client, keys),
                                                         self.options.exists_timeout_s), None)
        mask = mask if mask is not None else [False] * len(keys)
        self._count(exists_calls=1, exists_hits=sum(mask))
        return RegionArtifactExistsResult(existence_mask=tuple(mask), rpc_elapsed_s=time.perf_counter() - t0)

    def _check_transfers(self, transfers: Sequence[RegionArtifactTransfer]) -> int:
        """Validate a batch for this session's mode; its total bytes."""
        if any(type(t) is not RegionArtifactTransfer for t in transfers):
            raise RegionArtifactInputError("transfers must be RegionArtifactTransfer items")
        total = sum(t.span.byte_length for t in transfers)
        mode = self.options.transfer
        if isinstance(mode, AllocatorTransferOptions):
            outside = [i for i, t in enumerate(transfers) if self.region_of(t.span) is None]
            if outside:
                raise RegionArtifactInputError(f"allocator mode: span {outside[0]} (of {len(outside)}) lies in no "
                                               "region of this session (allocate_host_tensor)")
        elif total > mode.capacity_bytes:
            raise RegionArtifactInputError(f"scratch mode: a batch of {total} bytes exceeds the "
                                           f"{mode.capacity_bytes}-byte arena (capacity_bytes)")
        return total

    def _arena(self, direction: str, capacity: int) -> np.ndarray[Any, Any]:
        arena = self._arenas.get(direction)
        if arena is None:  # created on first use: a session that only reads never holds a put arena
            arena = self._arenas[direction] = np.empty(capacity, np.uint8)
        return arena

    def batch_put_from(self, transfers: Sequence[RegionArtifactTransfer]) -> RegionArtifactTransferResult:
        """Store each span's bytes as its artifact (an artifact already stored is kept: same key, same bytes)."""
        self._check_usable()
        total = self._check_transfers(transfers)
        op = f"put-{uuid.uuid4().hex[:12]}"
        if not transfers:
            return RegionArtifactTransferResult((), None, 0.0, 0.0, 0.0)
        keys = [t.artifact.kv_key for t in transfers]
        mode = self.options.transfer
        t0 = time.perf_counter()
        if isinstance(mode, ScratchTransferOptions):
            with self._arena_locks["put"]:
                arena = self._arena("put", mode.capacity_bytes)
                pages, offset = [], 0
                for t in transfers:
                    page = arena[offset : offset + t.span.byte_length]
                    np.copyto(page, t.span.view())
                    pages.append(page)
                    offset += t.span.byte_length
                t1 = time.perf_counter()
                ok = self._call(_Kind.PUT_FROM, self.client.kv.put(keys, pages), op) is not None
        else:
            t1 = t0
            ok = self._call(_Kind.PUT_FROM, self.client.kv.put(keys, [t.span.view() for t in transfers]),
                            op) is not None
        t2 = time.perf_counter()
        if ok:
            self._count(puts=len(keys), put_bytes=total)
        return RegionArtifactTransferResult((ok,) * len(keys), op, t1 - t0, 0.0, t2 - t1)

    def batch_get_into(self, transfers: Sequence[RegionArtifactTransfer]) -> RegionArtifactTransferResult:
        """Fill each span with its artifact's bytes; ``success_mask[i]`` is False for a miss."""
        self._check_usable()
        self._check_transfers(transfers)
        op = f"get-{uuid.uuid4().hex[:12]}"
        if not transfers:
            return RegionArtifactTransferResult((), None, 0.0, 0.0, 0.0)
        keys = [t.artifact.kv_key for t in transfers]
        mode = self.options.transfer
        t0 = time.perf_counter()
        if isinstance(mode, ScratchTransferOptions):
            with self._arena_locks["get"]:
                arena = self._arena("get", mode.capacity_bytes)
                bounds = np.cumsum([0, *(t.span.byte_length for t in transfers)]).tolist()
                stage = [arena[a:b] for a, b in itertools.pairwise(bounds)]
                hits = self._call(_Kind.GET_INTO, self.client.kv.get_into(keys, stage), op) or [False] * len(keys)
                t1 = time.perf_counter()
                for t, page, hit in zip(transfers, stage, hits, strict=True):
                    if hit:  # only whole, received pages reach the caller's memory
                        np.copyto(t.span.view(), page)
                t2 = time.perf_counter()
            rpc, copy = t1 - t0, t2 - t1
        else:
            buffers = [t.span.view() for t in transfers]
            hits = self._call(_Kind.GET_INTO, self.client.kv.get_into(keys, buffers), op) or [False] * len(keys)
            rpc, copy = time.perf_counter() - t0, 0.0
        self._count(gets=len(keys), get_hits=sum(hits),
                    get_bytes=sum(t.span.byte_length for t, h in zip(transfers, hits, strict=True) if h))
        return RegionArtifactTransferResult(tuple(bool(h) for h in hits), op, 0.0, copy, rpc)

    # ----------------------------------------------------------------- lifecycle
    def terminate_process_session(self) -> None:
        """End the session: later calls raise ``RegionSessionTerminatedError``. Idempotent. Regions stay
        valid while their tensors are referenced (their memory belongs to those tensors)."""
        with self.lock:
            if self.terminated:
                return
            self.terminated = True
        try:
            self.loop.run(self.client.close())
        except (TensorCastError, OSError, RuntimeError):
            pass  # closing a broken connection: nothing left to release on the cluster side
        finally:
            self.loop.stop()

    def __enter__(self) -> RegionBackedArtifactSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.terminate_process_session()
