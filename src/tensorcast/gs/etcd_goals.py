"""etcd backend of the global store: how many copies each artifact wants (``gs.etcd``'s replica goals).

Owns: ``P g/{artifact}`` -> the copies an artifact's placement wants, only when more than one (a put asking
for more raises it; the first record of an id, after a delete too, sets it), read with the artifact's record
and paged through by the under-replication query. A key left by a deleted artifact is removed when the query
meets it. Does not own: the other keys or the transactions' retries (``gs.etcd``, ``gs.etcd_client``).
"""

from __future__ import annotations

from collections.abc import Callable

from tensorcast.gs import etcd_records as codec
from tensorcast.gs.backend import GoalRow
from tensorcast.gs.etcd_client import EtcdClient, Txn, prefix_end

__all__ = ["decode", "note", "rows"]

Key = Callable[..., bytes]


def decode(raw: bytes | None) -> int:
    return int(raw) if raw else 1


async def note(tx: Txn, key: bytes, wanted: int, new: bool) -> None:
    """(Inside the commit's transaction; ``key`` is its ``g/`` key, prefetched.) ``new``: the artifact's first
    record."""
    raw = await tx.get(key)
    goal = wanted if new else max(decode(raw), wanted)
    if goal > 1 and raw != str(goal).encode():
        tx.put(key, str(goal).encode())
    elif goal <= 1 and raw is not None:
        tx.delete(key)


async def rows(etcd: EtcdClient, k: Key, holder: str, after: str, limit: int) -> tuple[list[GoalRow], str]:
    base = k("g", "")
    start = base + after.encode() + b"\0" if after else base
    kvs = (await etcd.range(start, prefix_end(base), limit))[0]
    out: list[GoalRow] = []
    for kv in kvs:
        aid = kv.key[len(base):].decode()
        got = await etcd.get_many([k("a", aid), k("r", aid)])
        record, replicas = got[k("a", aid)][1], got[k("r", aid)][1]
        if record is None:
            await _forget(etcd, k, aid)
            continue
        held = sorted(codec.REPLICAS.decode(replicas)) if replicas else []
        if not holder or any(w == holder for w, _ in held):
            out.append((aid, decode(bytes(kv.value)), held))
    return out, kvs[-1].key[len(base):].decode() if len(kvs) == limit else ""


async def _forget(etcd: EtcdClient, k: Key, aid: str) -> None:
    """Remove a goal whose artifact is gone, unless the artifact was put again meanwhile."""

    async def decide(tx: Txn) -> None:
        if await tx.get(k("a", aid)) is None:
            tx.delete(k("g", aid))

    await etcd.atomically(decide)
