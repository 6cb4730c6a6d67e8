"""How the etcd backend encodes its records (``gs.etcd``): the value of each kind of key, as msgpack.

Owns: the record structs, their decoders, and the two conversions the backend needs (a worker record with
its latest heartbeat, a lease record's bytes). Does not own: the keys or the transactions.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tensorcast.kv.leases import LeaseRecord
from tensorcast.records import InstanceInfo, TensorMeta, WorkerInfo

__all__ = ["ENC", "A", "IR", "INSTANCE", "L", "REPLICAS", "STATS", "T", "TIERS", "W", "Artifact", "Instance",
           "Lease", "Tomb", "Worker", "encode_lease", "with_stats"]

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
    lease_expiry: float | None
    policy: str
    meta: dict[str, str]


class Tomb(msgspec.Struct, array_like=True):
    artifact_id: str
    reason: str
    at: float


class Lease(msgspec.Struct, array_like=True):
    holder: str
    token: int
    expiry: float
    acquired_at: float


W = msgspec.msgpack.Decoder(Worker)
A = msgspec.msgpack.Decoder(Artifact)
T = msgspec.msgpack.Decoder(Tomb)
L = msgspec.msgpack.Decoder(Lease)
INSTANCE = msgspec.msgpack.Decoder(InstanceInfo)
IR = msgspec.msgpack.Decoder(Instance)
STATS = msgspec.msgpack.Decoder(dict[str, Any])
TIERS = msgspec.msgpack.Decoder(list[str])
REPLICAS = msgspec.msgpack.Decoder(list[tuple[str, str]])


def with_stats(info: WorkerInfo, beat: dict[str, Any] | None) -> WorkerInfo:
    """A worker record with its latest heartbeat (none: its liveness lease expired, so it is not alive)."""
    if beat is None:
        return msgspec.structs.replace(info, last_heartbeat=0.0)
    fields = {k: v for k, v in beat.items() if k in WorkerInfo.__struct_fields__}
    return msgspec.structs.replace(info, **fields)


def encode_lease(r: LeaseRecord) -> bytes:
    return ENC.encode(Lease(r.holder, r.token, r.expiry, r.acquired_at))
