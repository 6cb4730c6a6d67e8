"""Every error TensorCast raises, and the codes they travel under on the wire.

The tree::

    TensorCastError                 code            retryable
    ├── NotFound                    NOT_FOUND        no   unknown artifact, key, worker, tensor name
    ├── AlreadyExists               ALREADY_EXISTS   no   a KV page key already names other bytes
    ├── InvalidArgument             INVALID_ARGUMENT no   bad dtype/shape/key/config, malformed or unknown message
    ├── DeadlineExceeded            DEADLINE_EXCEEDED yes the call's deadline passed (before or during the work)
    ├── Unauthenticated             UNAUTHENTICATED  no   missing or wrong credential, no handshake, TLS refused
    ├── PermissionDenied            PERMISSION_DENIED no  the credential's role may not send this request
    ├── ResourceExhausted           RESOURCE_EXHAUSTED yes pool capacity, oversized frame, the global store's
    │                                                     database or disk full, a bounded index full
    ├── Unavailable                 UNAVAILABLE      yes  peer down, connection lost, no live replica
    │   └── ChunkCorrupted          CHUNK_CORRUPTED  yes  received bytes failed their checksum (none kept)
    ├── StaleFencingToken           STALE_FENCING_TOKEN yes a shard lease changed hands; refresh and retry
    ├── VersionConflict             VERSION_CONFLICT no   a weight swap expected another active version (stale CAS)
    ├── SwapAborted                 SWAP_ABORTED     no   a weight swap was abandoned: every rank kept its old version
    └── InternalError               INTERNAL         no   a bug: the remote side failed unexpectedly

Each class carries a wire ``code`` and whether a retry may succeed (``retryable``). A remote failure is
raised on the caller side as the same class with the remote message, so ``except tc.errors.NotFound``
works across processes. This module owns the mapping; it does not decide retry policy.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "AlreadyExists",
    "ChunkCorrupted",
    "DeadlineExceeded",
    "InternalError",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "StaleFencingToken",
    "SwapAborted",
    "TensorCastError",
    "Unauthenticated",
    "Unavailable",
    "VersionConflict",
    "clip",
    "error_from_code",
]

# Longest caller-supplied text (a key, a path, a name) an error message repeats.
CLIP_CHARS = 200


class TensorCastError(Exception):
    """Base of every TensorCast error."""

    code: ClassVar[str] = "UNKNOWN"
    retryable: ClassVar[bool] = False

    def __init__(self, message: str = "", *, trace_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.trace_id = trace_id

    def __str__(self) -> str:
        suffix = f" [trace {self.trace_id}]" if self.trace_id else ""
        return f"{self.code}: {self.message}{suffix}"


class NotFound(TensorCastError):
    code = "NOT_FOUND"


class AlreadyExists(TensorCastError):
    """A write under a name that already names something else: a KV put of different bytes (or size) under
    a key already stored. A key names one page; the same bytes again are accepted (idempotent)."""

    code = "ALREADY_EXISTS"


class InvalidArgument(TensorCastError):
    code = "INVALID_ARGUMENT"


class DeadlineExceeded(TensorCastError):
    code = "DEADLINE_EXCEEDED"
    retryable = True


class Unauthenticated(TensorCastError):
    code = "UNAUTHENTICATED"


class PermissionDenied(TensorCastError):
    """The connection's credential is valid, but its role may not send this request (``wire.protocol``'s
    ``REQUIRED_ROLE``): a read-only credential deleting, a client registering a worker."""

    code = "PERMISSION_DENIED"


class ResourceExhausted(TensorCastError):
    code = "RESOURCE_EXHAUSTED"
    retryable = True


class Unavailable(TensorCastError):
    code = "UNAVAILABLE"
    retryable = True


class ChunkCorrupted(Unavailable):
    """A received chunk failed its checksum; nothing of that transfer was kept. Retryable."""

    code = "CHUNK_CORRUPTED"


class StaleFencingToken(TensorCastError):
    code = "STALE_FENCING_TOKEN"
    retryable = True


class VersionConflict(TensorCastError):
    """A weight swap's compare-and-swap failed: the binding's active version is not the one the caller
    expected. Not retryable as is: read the active version and decide again."""

    code = "VERSION_CONFLICT"


class SwapAborted(TensorCastError):
    """A weight swap (of one binding or a tensor-parallel group) was abandoned before any live tensor was
    touched: a rank failed to prepare, the deadline left no time to activate, or the staged swap was
    replaced, aborted or expired. Every rank kept its old version; running the swap again may succeed."""

    code = "SWAP_ABORTED"


class InternalError(TensorCastError):
    code = "INTERNAL"


_BY_CODE: dict[str, type[TensorCastError]] = {
    cls.code: cls
    for cls in (
        NotFound,
        AlreadyExists,
        InvalidArgument,
        DeadlineExceeded,
        Unauthenticated,
        PermissionDenied,
        ResourceExhausted,
        Unavailable,
        ChunkCorrupted,
        StaleFencingToken,
        VersionConflict,
        SwapAborted,
        InternalError,
    )
}


def clip(value: object, limit: int = CLIP_CHARS) -> str:
    """``repr(value)`` for an error message, cut to about ``limit`` characters: a message never echoes a
    megabyte key back."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def error_from_code(code: str, message: str, trace_id: str | None = None) -> TensorCastError:
    """Rebuild the typed error a peer reported; unknown codes become ``InternalError``."""
    cls = _BY_CODE.get(code, InternalError)
    if cls is InternalError and code != InternalError.code:
        message = f"{code}: {message}"
    return cls(message, trace_id=trace_id)
