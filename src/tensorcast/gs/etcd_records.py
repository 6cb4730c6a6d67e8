"""How the etcd backend encodes its records (``gs.etcd``): the value of each kind of key, as msgpack.

Owns: the record structs, their decoders, and the conversions the backend needs (a worker record with its
latest heartbeat, a lease record's bytes, a key binding's value, an artifact's references from its record and
its keys). Does not own: the keys or the transactions.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tensorcast.gs.refs import References, legacy
from tensorcast.kv.leases import LeaseRecord
from tensorcast.records import InstanceInfo, TensorMeta, WorkerInfo

__all__ = ["ARTIFACT", "ENC", "INSTANCE", "INSTANCE_RECORD", "LEASE", "REPLICAS", "STATS", "TIERS", "TOMB", "WORKER",
           "Artifact", "Binding", "Instance", "Lease", "Tomb", "Worker", "binding", "encode_binding", "encode_expiry",
           "encode_lease", "expiry", "references", "with_stats"]

ENC = msgspec.msgpack.Encoder()


class Worker(msgspec.Struct, array_like=True):
    info: WorkerInfo
    lease: int = 0


class Instance(msgspec.Struct, array_like=True):
    info: InstanceInfo
    lease: int = 0


class Artifact(msgspec.Struct, array_like=True):
    tensors: tuple[TensorMeta, ...]
    nbytes: int
    created_at: float
    lease_expiry: float | None  # the anonymous reference's lease (None: a system hold, or no such reference)
    policy: str
    meta: dict[str, str]
    # Whether puts without a key hold it. None: a record from before key references, whose ``lease_expiry``
    # was the whole artifact's ownership (``gs.refs.legacy``; converted when a global store opens).
    anonymous: bool | None = None


class Binding(msgspec.Struct, array_like=True):
    """The value of ``k/{key}``: the artifact the key names and the binding's lease (None: permanent)."""

    artifact_id: str
    expiry: float | None = None


class Tomb(msgspec.Struct, array_like=True):
    artifact_id: str
    reason: str
    at: float


class Lease(msgspec.Struct, array_like=True):
    holder: str
    token: int
    expiry: float
    acquired_at: float


# Decoders, each named by the value it reads (``codec.WORKER.decode(raw)``: a ``Worker`` record).
WORKER = msgspec.msgpack.Decoder(Worker)
ARTIFACT = msgspec.msgpack.Decoder(Artifact)
TOMB = msgspec.msgpack.Decoder(Tomb)
LEASE = msgspec.msgpack.Decoder(Lease)
INSTANCE = msgspec.msgpack.Decoder(InstanceInfo)  # an instance's heartbeat value
INSTANCE_RECORD = msgspec.msgpack.Decoder(Instance)
STATS = msgspec.msgpack.Decoder(dict[str, Any])
TIERS = msgspec.msgpack.Decoder(list[str])
REPLICAS = msgspec.msgpack.Decoder(list[tuple[str, str]])
_BINDING = msgspec.msgpack.Decoder(Binding)
_EXPIRY = msgspec.msgpack.Decoder(float | None)


def binding(raw: bytes) -> Binding:
    """A ``k/{key}`` value; one written before key references is the bare artifact id."""
    return Binding(raw.decode()) if raw.startswith(b"tc-") else _BINDING.decode(raw)


def encode_binding(artifact_id: str, expiry: float | None) -> bytes:
    return ENC.encode(Binding(artifact_id, expiry))


def expiry(raw: bytes) -> float | None:
    """A ``ka/{artifact}/{key}`` value: the binding's lease (empty, from before key references: None)."""
    return _EXPIRY.decode(raw) if raw else None


def encode_expiry(value: float | None) -> bytes:
    return ENC.encode(value)


def references(rec: Artifact, bindings: tuple[tuple[str, float | None], ...]) -> References:
    """An artifact's references from its record and its ``(key, expiry)`` bindings."""
    if rec.anonymous is None:
        return legacy(rec.lease_expiry, (k for k, _ in bindings))
    return References(bindings, rec.anonymous, rec.lease_expiry if rec.anonymous else None)


def with_stats(info: WorkerInfo, beat: dict[str, Any] | None) -> WorkerInfo:
    """A worker record with its latest heartbeat (none: its liveness lease expired, so it is not alive)."""
    if beat is None:
        return msgspec.structs.replace(info, last_heartbeat=0.0)
    fields = {k: v for k, v in beat.items() if k in WorkerInfo.__struct_fields__}
    return msgspec.structs.replace(info, **fields)


def encode_lease(r: LeaseRecord) -> bytes:
    return ENC.encode(Lease(r.holder, r.token, r.expiry, r.acquired_at))
