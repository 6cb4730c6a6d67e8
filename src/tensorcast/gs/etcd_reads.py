"""The etcd backend's artifact reads: records, references, replicas and tombstones as the layout of ``gs.etcd``
keeps them, read outside a transaction or inside one (``Txn``).

Owns: the key names under the prefix (``_k``), looking up a key's binding, an artifact's record with its
references and the copies it wants, its replicas, listing keys and unkeyed artifacts a page at a time (the
cursor of ``gs.refs``), the sizes behind keys, tombstones, and which references' leases have ended (the
``le/`` and ``kl/`` indexes, by expiry). Does not own: any write (``gs.etcd_artifacts``), the record encodings
(``gs.etcd_records``), workers, instances or shard leases (``gs.etcd``).
"""

from __future__ import annotations

import asyncio

from tensorcast.gs import etcd_goals
from tensorcast.gs import etcd_records as codec
from tensorcast.gs.backend import ArtifactRow, GoalRow, MetadataBackend
from tensorcast.gs.etcd_client import EtcdClient, Txn, prefix_end
from tensorcast.gs.refs import list_cursor, live, parse_cursor
from tensorcast.records import ArtifactInfo

__all__ = ["Bindings", "EtcdArtifactReads"]

Bindings = tuple[tuple[str, float | None], ...]


class EtcdArtifactReads(MetadataBackend):
    etcd: EtcdClient
    p: bytes

    def _k(self, *parts: str) -> bytes:
        return self.p + "/".join(parts).encode()

    async def resolve_key(self, key: str) -> tuple[str, float | None] | None:
        raw = await self.etcd.get(self._k("k", key))
        if raw is None:
            return None
        b = codec.binding(raw)
        return b.artifact_id, b.expiry

    async def _key_values(self, aid: str) -> list[tuple[str, bytes]]:
        base = self._k("ka", aid, "")
        return [(kv.key[len(base):].decode(), bytes(kv.value)) for kv in await self.etcd.prefix(base)]

    async def _bindings(self, aid: str) -> Bindings:
        return tuple((k, codec.expiry(v)) for k, v in await self._key_values(aid))

    async def _replicas(self, tx: Txn, aid: str) -> list[tuple[str, str]]:
        raw = await tx.get(self._k("r", aid))
        return [] if raw is None else codec.REPLICAS.decode(raw)

    async def get_artifact(self, artifact_id: str) -> ArtifactRow | None:
        got = await self.etcd.get_many([self._k("a", artifact_id), self._k("g", artifact_id)])  # one round trip
        raw = got[self._k("a", artifact_id)][1]
        if raw is None:
            return None
        rec = codec.ARTIFACT.decode(raw)
        info = ArtifactInfo(id=artifact_id, tensors=rec.tensors, nbytes=rec.nbytes, created_at=rec.created_at,
                            policy=rec.policy, meta=rec.meta,
                            replicas_wanted=etcd_goals.decode(got[self._k("g", artifact_id)][1]))
        return ArtifactRow(info, codec.references(rec, await self._bindings(artifact_id)))

    async def replica_goals(self, holder: str, after: str, limit: int) -> tuple[list[GoalRow], str]:
        return await etcd_goals.rows(self.etcd, self._k, holder, after, limit)

    async def replicas_of(self, artifact_id: str) -> list[tuple[str, str]]:
        raw = await self.etcd.get(self._k("r", artifact_id))
        return [] if raw is None else sorted(codec.REPLICAS.decode(raw))

    async def list_artifacts(self, prefix: str, limit: int, after: str, now: float
                             ) -> tuple[list[tuple[str | None, str]], str]:
        kind, mark = parse_cursor(after)
        out: list[tuple[str | None, str]] = []
        if kind != "a":
            base = self._k("k", "")
            start = base + max(prefix, mark + "\0" if mark else "").encode()
            kvs = (await self.etcd.range(start, prefix_end(base + prefix.encode()), limit))[0]
            for kv in kvs:
                b = codec.binding(bytes(kv.value))
                if live(b.expiry, now):
                    out.append((kv.key[len(base):].decode(), b.artifact_id))
            if len(kvs) == limit:
                return out, list_cursor(kvs[-1].key[len(base):].decode(), "")
            if prefix:
                return out, ""
            mark = ""
        base, n = self._k("a", ""), limit - len(out)
        start = base + mark.encode() + b"\0" if mark else base
        ids = [kv.key[len(base):].decode()
               for kv in (await self.etcd.range(start, prefix_end(base), n, keys_only=True))[0]]
        counts = await asyncio.gather(*(self.etcd.range(self._k("ka", aid, ""), prefix_end(self._k("ka", aid, "")),
                                                        count_only=True) for aid in ids))
        out += [(None, aid) for aid, (_kvs, count, _rev) in zip(ids, counts, strict=True) if count == 0]
        return out, list_cursor(None, ids[-1]) if len(ids) == n else ""

    async def key_sizes(self, limit: int) -> tuple[list[tuple[str, int]], int]:
        total = (await self.etcd.range(self._k("a", ""), prefix_end(self._k("a", "")), count_only=True))[1]
        if limit <= 0:
            return [], total
        base = self._k("k", "")
        out = []
        for kv in (await self.etcd.range(base, prefix_end(base), limit))[0]:
            raw = await self.etcd.get(self._k("a", codec.binding(bytes(kv.value)).artifact_id))
            if raw is not None:
                out.append((kv.key[len(base):].decode(), codec.ARTIFACT.decode(raw).nbytes))
        return out, total

    async def tombstone(self, key_or_id: str) -> tuple[str, str] | None:
        raw = await self.etcd.get(self._k("t", key_or_id)) or await self.etcd.get(self._k("tk", key_or_id))
        if raw is None:
            return None
        t = codec.TOMB.decode(raw)
        return t.artifact_id, t.reason

    async def expired_references(self, now: float) -> list[tuple[str, str | None]]:
        out: list[tuple[str, str | None]] = []
        for kind in ("le", "kl"):
            base = self._k(kind, "")
            for kv in (await self.etcd.range(base, self._k(kind, f"{now:020.6f}", "\xff")))[0]:
                aid, _, key = kv.key[len(base) + 21:].decode().partition("/")
                out.append((aid, key if kind == "kl" else None))
        return out
