"""The values of the byte-artifact session API: identities, host spans, transfers, results, options, failures.

A *byte artifact* is one opaque run of bytes named by a keyspace (namespace, engine, model, model version,
layout) and an engine key (the engine's own hash). It is stored as one KV page whose key is derived from
that identity and the byte length (``ByteArtifactSpec.kv_key``), so two artifacts share bytes only when
every identity input agrees, and a reader expecting another length sees a miss rather than wrong bytes.
A *host span* is a range of caller-owned CPU memory (a tensor or array) that a transfer fills or reads.

Owns: validating these values (``RegionArtifactInputError``), the key derivation, and viewing a span's
memory as a writable uint8 array without a copy. Does not own: moving bytes or talking to a cluster
(``tensorcast.api.store``), nor what an engine puts in its keys.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

import blake3
import msgspec
import numpy as np

from tensorcast.errors import InvalidArgument, Unavailable

__all__ = [
    "AllocatorTransferOptions",
    "ByteArtifactKeyspace",
    "ByteArtifactSpec",
    "HostMemorySpan",
    "RegionArtifactExistsResult",
    "RegionArtifactInputError",
    "RegionArtifactTransfer",
    "RegionArtifactTransferResult",
    "RegionBackedArtifactSessionOptions",
    "RegionSessionFailedError",
    "RegionSessionFailure",
    "RegionSessionFailureCode",
    "RegionSessionOperationKind",
    "RegionSessionTerminatedError",
    "ScratchTransferOptions",
]

# An engine key is hex-encoded into the page key, which holds at most 512 bytes: 200 bytes leave room.
MAX_ENGINE_KEY_BYTES = 200
_KEY_SCHEMA = "ba1"  # bump when the derivation below changes: old pages then read as misses
_ENC = msgspec.msgpack.Encoder()


class RegionArtifactInputError(InvalidArgument):
    """A spec, span, transfer or option is malformed (the caller's mistake; the session stays usable)."""


class RegionSessionTerminatedError(InvalidArgument):
    """The session was terminated (``terminate_process_session``); attach a new one in a new process."""


class RegionSessionFailureCode(StrEnum):
    TRANSPORT = "transport"  # the cluster could not be reached
    TIMEOUT = "timeout"
    UNAUTHENTICATED = "unauthenticated"
    INTERNAL = "internal"


class RegionSessionOperationKind(StrEnum):
    ATTACH = "attach"
    ALLOCATE = "allocate"
    EXISTS = "exists"
    GET_INTO = "get_into"
    PUT_FROM = "put_from"


@dataclass(frozen=True, slots=True)
class RegionSessionFailure:
    """Why a session failed: once failed, every later call raises ``RegionSessionFailedError`` with it."""

    code: RegionSessionFailureCode
    message: str
    operation_kind: RegionSessionOperationKind
    operation_id: str | None
    occurred_at: datetime


class RegionSessionFailedError(Unavailable):
    """The session failed for good (``failure`` says why); a retry in this session fails the same way."""

    def __init__(self, failure: RegionSessionFailure) -> None:
        super().__init__(f"{failure.operation_kind.value} failed ({failure.code.value}): {failure.message}")
        self.failure = failure


def _text(value: object, what: str) -> str:
    if type(value) is not str or not value.strip():
        raise RegionArtifactInputError(f"{what} must be a non-empty str, got {value!r:.80}")
    return value


def _positive_int(value: object, what: str) -> int:
    if type(value) is not int or value <= 0:
        raise RegionArtifactInputError(f"{what} must be a positive int, got {value!r:.80}")
    return value


@dataclass(frozen=True, slots=True)
class ByteArtifactKeyspace:
    """Who a byte artifact belongs to; artifacts are shared only within one keyspace."""

    namespace: str
    engine: str
    model_id: str
    model_version: str
    layout_id: str

    def __post_init__(self) -> None:
        for name in ("namespace", "engine", "model_id", "model_version", "layout_id"):
            _text(getattr(self, name), f"keyspace {name}")


@functools.lru_cache(maxsize=256)
def _keyspace_digest(keyspace: ByteArtifactKeyspace) -> str:
    # Hashed, not spelled out: model ids are free text (paths, slashes) and the page key is bounded.
    doc = [_KEY_SCHEMA, keyspace.namespace, keyspace.engine, keyspace.model_id, keyspace.model_version,
           keyspace.layout_id]
    return str(blake3.blake3(_ENC.encode(doc)).hexdigest())[:32]


@dataclass(frozen=True, slots=True)
class ByteArtifactSpec:
    """One byte artifact: its keyspace, the engine's key for it, and its exact length in bytes."""

    keyspace: ByteArtifactKeyspace
    engine_key: bytes
    byte_length: int

    def __post_init__(self) -> None:
        if type(self.keyspace) is not ByteArtifactKeyspace:
            raise RegionArtifactInputError(f"keyspace must be a ByteArtifactKeyspace, got {type(self.keyspace)}")
        if type(self.engine_key) is not bytes or not 0 < len(self.engine_key) <= MAX_ENGINE_KEY_BYTES:
            raise RegionArtifactInputError(f"engine_key must be 1..{MAX_ENGINE_KEY_BYTES} bytes")
        _positive_int(self.byte_length, "byte_length")

    @property
    def kv_key(self) -> str:
        """The KV page key this artifact is stored under (its length is part of it)."""
        return f"{_KEY_SCHEMA}/{_keyspace_digest(self.keyspace)}/{self.engine_key.hex()}/{self.byte_length}"


def _buffer_of(obj: Any) -> tuple[int, int]:
    """(address, bytes) of a contiguous CPU tensor or array, without touching its data."""
    if type(obj).__module__.startswith("torch"):
        if obj.device.type != "cpu":
            raise RegionArtifactInputError(f"host spans need CPU memory, got a {obj.device.type} tensor")
        if not obj.is_contiguous():
            raise RegionArtifactInputError("host spans need a contiguous tensor")
        return int(obj.data_ptr()), int(obj.numel() * obj.element_size())
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise RegionArtifactInputError("host spans need a C-contiguous array")
        return int(obj.ctypes.data), int(obj.nbytes)
    raise RegionArtifactInputError(f"host spans come from a CPU torch tensor or numpy array, got {type(obj)}")


@dataclass(frozen=True, slots=True)
class HostMemorySpan:
    """``byte_length`` bytes of host memory at ``address``; ``owner`` (the tensor it lies in) keeps it alive."""

    address: int
    byte_length: int
    owner: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        _positive_int(self.address, "span address")
        _positive_int(self.byte_length, "span byte_length")

    @classmethod
    def from_tensor(cls, tensor: Any, *, offset_bytes: int, byte_length: int) -> HostMemorySpan:
        """The bytes ``[offset_bytes, offset_bytes + byte_length)`` of a contiguous CPU tensor or array."""
        base, nbytes = _buffer_of(tensor)
        if type(offset_bytes) is not int or offset_bytes < 0:
            raise RegionArtifactInputError(f"offset_bytes must be a non-negative int, got {offset_bytes!r:.80}")
        _positive_int(byte_length, "byte_length")
        if offset_bytes + byte_length > nbytes:
            raise RegionArtifactInputError(f"span [{offset_bytes}, {offset_bytes + byte_length}) lies outside its "
                                           f"{nbytes}-byte tensor")
        return cls(base + offset_bytes, byte_length, tensor)

    def view(self) -> np.ndarray[Any, Any]:
        """The span as a writable uint8 array over the same memory (no copy); valid while ``owner`` lives."""
        raw = (ctypes.c_uint8 * self.byte_length).from_address(self.address)
        return np.frombuffer(memoryview(raw).cast("B"), np.uint8)


@dataclass(frozen=True, slots=True)
class RegionArtifactTransfer:
    """Move one artifact between the store and one host span of exactly its length."""

    artifact: ByteArtifactSpec
    span: HostMemorySpan

    def __post_init__(self) -> None:
        if type(self.artifact) is not ByteArtifactSpec or type(self.span) is not HostMemorySpan:
            raise RegionArtifactInputError("a transfer is a ByteArtifactSpec and a HostMemorySpan")
        if self.span.byte_length != self.artifact.byte_length:
            raise RegionArtifactInputError(f"span holds {self.span.byte_length} bytes, artifact "
                                           f"{self.artifact.byte_length}")


@dataclass(frozen=True, slots=True)
class RegionArtifactExistsResult:
    """``existence_mask[i]``: artifact ``i`` is stored (exactly, not a prefix count)."""

    existence_mask: tuple[bool, ...]
    rpc_elapsed_s: float


@dataclass(frozen=True, slots=True)
class RegionArtifactTransferResult:
    """``success_mask[i]``: transfer ``i`` completed (a get: its span holds the artifact's bytes)."""

    success_mask: tuple[bool, ...]
    operation_id: str | None
    pack_elapsed_s: float
    copy_elapsed_s: float
    rpc_elapsed_s: float


@dataclass(frozen=True, slots=True)
class AllocatorTransferOptions:
    """Transfers read and write spans directly; every span must lie in a region this session allocated."""


@dataclass(frozen=True, slots=True)
class ScratchTransferOptions:
    """Transfers stage through one arena per direction of ``capacity_bytes``; spans may be any host memory."""

    capacity_bytes: int = 16 * 1024 * 1024

    def __post_init__(self) -> None:
        _positive_int(self.capacity_bytes, "scratch capacity_bytes")


@dataclass(frozen=True, slots=True)
class RegionBackedArtifactSessionOptions:
    """How to attach: ``daemon_address`` is a TensorCast gateway (``HOST:PORT``); ``token`` its cluster token.

    ``transfer_timeout_s`` bounds each request of a get or put to a shard home; ``exists_timeout_s`` bounds a
    whole existence query."""

    daemon_address: str
    session_name: str = "tensorcast"
    transfer: AllocatorTransferOptions | ScratchTransferOptions = field(default_factory=AllocatorTransferOptions)
    transfer_timeout_s: float | None = None
    exists_timeout_s: float = 30.0
    region_name_prefix: str = "tensorcast"
    token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        _text(self.daemon_address, "daemon_address")
        _text(self.session_name, "session_name")
        _text(self.region_name_prefix, "region_name_prefix")
        if not isinstance(self.transfer, AllocatorTransferOptions | ScratchTransferOptions):
            raise RegionArtifactInputError(f"transfer must be allocator or scratch options, got {self.transfer!r}")
        for name in ("transfer_timeout_s", "exists_timeout_s"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                      or not 0 < value < float("inf")):
                raise RegionArtifactInputError(f"{name} must be a positive number of seconds, got {value!r}")
