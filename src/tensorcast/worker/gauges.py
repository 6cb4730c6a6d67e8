"""What a worker reports when Prometheus scrapes it: its pool, data plane, shard leases and plans.

Owns: turning the roles' current state into metric samples (``worker_samples``). Reads state only; the
event metrics (operations, RPCs, KV page ops, plan steps) are recorded where they happen. Does not own:
serving them (``obs.http``) or the state itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from tensorcast import clock
from tensorcast.obs.metrics import Sample

if TYPE_CHECKING:
    from tensorcast.kv.home import ShardHome
    from tensorcast.worker.gateway import GatewayRole
    from tensorcast.worker.storage import StorageRole

__all__ = ["worker_samples"]

_POOL = "Bytes in a worker's pool, by tier and state (used, capacity, pinned, reserved for puts in flight, " \
        "prefaulted: shared memory faulted in ahead of use, beyond capacity)."


def worker_samples(worker_id: str, storage: StorageRole, kv_home: ShardHome | None,
                   gateway: GatewayRole | None) -> Iterator[Sample]:
    w = {"worker": worker_id}
    store = storage.store
    state = store.memory.state
    for tier, kind, value in (
        ("memory", "used", state.used), ("memory", "capacity", state.capacity),
        ("memory", "reserved", state.reserved), ("memory", "pinned", state.pinned_bytes(clock.time())),
        ("memory", "prefaulted", store.memory.stock.ready_bytes),
        ("disk", "used", store.disk.used if store.disk else 0),
        ("disk", "capacity", store.disk.capacity if store.disk else 0),
        ("device", "used", storage.devices.used),
    ):
        yield Sample("tensorcast_pool_bytes", _POOL, {**w, "tier": tier, "state": kind}, value)
    yield Sample("tensorcast_pool_evicted_bytes", "Memory freed by evicting replicas.", w, store.evicted_bytes,
                 counter=True)
    for tier, count in (("memory", len(state.replicas)), ("disk", len(store.disk.manifests) if store.disk else 0)):
        yield Sample("tensorcast_pool_replicas", "Artifacts with a replica on this worker, by tier (memory, disk).",
                     {**w, "tier": tier}, count)
    moved = dict(storage.moved)
    moved[storage.parts.config.transport.kind, "sent"] = storage.data_server.bytes_sent
    for (transport, direction), nbytes in sorted(moved.items()):
        yield Sample("tensorcast_transport_bytes", "Bytes a worker moved, by transport (tcp or inproc: the data "
                     "plane; rpc: put payloads; shm: same-host puts and maps; disk: its own disk tier) and "
                     "direction.", {**w, "transport": transport, "direction": direction}, nbytes, counter=True)
    yield Sample("tensorcast_transfers_in_flight", "Data-plane transfers running now (fetches and sends).", w,
                 storage.transfers_in_flight())
    if kv_home is not None:
        yield Sample("tensorcast_kv_shard_leases_held", "KV shards this shard home holds a lease on.", w,
                     len(kv_home.leases.held))
        yield Sample("tensorcast_kv_pages_stored", "KV pages a shard home holds.", w, len(kv_home.store.index))
        yield Sample("tensorcast_kv_page_bytes", "Bytes of KV page slots a shard home holds.", w,
                     kv_home.store.used)
        handover = kv_home.handover
        yield Sample("tensorcast_kv_pages_kept", "KV pages a shard home keeps of shards it does not serve (for "
                     "their next holder to pull, or as a backup).", w, kv_home.kept_pages())
        for direction, count in (("received", handover.pulled), ("sent", handover.handed)):
            yield Sample("tensorcast_kv_handover_pages", "KV pages moved between shard homes when a shard changed "
                         "holder, by direction.", {**w, "direction": direction}, count, counter=True)
        for result, count in (("ok", handover.copied), ("failed", handover.copy_failures)):
            yield Sample("tensorcast_kv_backup_copies", "KV pages copied to backup shard homes (kv.replicas), and "
                         "copies to a backup that failed.", {**w, "result": result}, count, counter=True)
    if gateway is not None:
        yield Sample("tensorcast_plans_in_flight", "Plans a gateway is running now.", w, gateway.plans.in_flight)
