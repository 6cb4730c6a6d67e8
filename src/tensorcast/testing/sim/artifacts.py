"""A simulated artifact client: durable puts, reads and deletes of keys, through the real client code.

Owns ``SimArtifacts``, a caller on another host (its own process on the simulated network): puts go through
``client.puts.put_tensors`` to a worker it picks (inline ``PutBegin`` for small artifacts, ``PutBegin`` /
``PutData`` / ``PutCommit`` for larger ones), reads are ``GetArtifact`` through a gateway (relayed to the global
store) and the bytes fetched from a holder with ``client.reads.Reader`` over the simulated data plane, and
deletes are ``DeleteArtifact`` of one key through a gateway. Keys come in siblings (``sim/a7/a``,
``sim/a7/b``: the same bytes, so one artifact with two keys); deleting one must leave the other readable.
Every byte read is checked (``checker.artifact_bytes``); every acknowledgement is recorded in the checker's
``ArtifactLedger``. Does not own: the promises (``sim.checker``) or the cluster (``sim.cluster``).
"""

from __future__ import annotations

import contextlib
import logging
import random

from tensorcast.client.locality import Locality
from tensorcast.client.puts import put_tensors
from tensorcast.client.reads import Reader
from tensorcast.client.write_maps import SegmentWriter
from tensorcast.errors import NotFound, TensorCastError
from tensorcast.records import ArtifactInfo
from tensorcast.tensors import TensorInput
from tensorcast.testing.sim.checker import ArtifactLedger, InvariantBroken, artifact_bytes, stem_of
from tensorcast.testing.sim.cluster import SimCluster, SimWorker
from tensorcast.testing.sim.net import SimCaller, SimDataPlane
from tensorcast.wire.messages import DeleteArtifact, GetArtifact

__all__ = ["SimArtifacts"]

log = logging.getLogger("tensorcast.sim")

TENSOR = "w"


class SimArtifacts:
    def __init__(self, cluster: SimCluster, ledger: ArtifactLedger, rng: random.Random, name: str = "a0") -> None:
        self.cluster = cluster
        self.ledger = ledger
        self.rng = rng
        self.caller = SimCaller(cluster.net, name, timeout=10.0)
        self.locality = Locality(name, shared_memory=False)  # another host: the bytes travel as payloads
        self.writer = SegmentWriter()
        self.reader = Reader(self.caller, SimDataPlane(cluster.net, name), self.locality, cluster.config)
        self.stems = 0

    def _gateway(self) -> bool:
        """Point the caller at a live worker (and the others after it); False when none is alive."""
        live = [w.id for w in self.cluster.live()]
        if not live:
            return False
        self.rng.shuffle(live)
        self.caller.defaults, self.caller.address = live, live[0]
        return True

    def new_key(self) -> str:
        """A key of a new stem, or (one in three) a sibling of a key put before: the same bytes."""
        if self.ledger.acked and self.rng.random() < 0.33:
            return f"{stem_of(self.rng.choice(sorted(self.ledger.acked)))}/s{len(self.ledger.acked)}"
        self.stems += 1
        return f"sim/a{self.stems}/a"

    async def put(self, key: str, worker: SimWorker | None = None) -> ArtifactInfo:
        """A durable put of ``key``'s bytes to ``worker`` (else a live one); recorded once acknowledged."""
        live = self.cluster.live()
        target = worker or self.rng.choice(live)
        data = artifact_bytes(key)
        inputs = [TensorInput(TENSOR, "uint8", (data.nbytes,), data)]
        info = await put_tensors(self.caller, self.locality, self.writer, target.id, inputs, key=key, ttl=None,
                                 policy="durable", ctx=self.caller.context(timeout=10.0))
        self.ledger.ack(key, info.id)
        return info

    async def read(self, key: str) -> bool:
        """Read ``key`` through a gateway and a holder, checking every byte; False if it cannot be read now."""
        if not self._gateway():
            return False
        ctx = self.caller.context(timeout=10.0)
        try:
            info = (await self.caller.call(GetArtifact(key_or_id=key), ctx)).artifact
            tensors, _ = await self.reader.materialize(info, (TENSOR,), "numpy", ctx=ctx)
        except TensorCastError as exc:
            log.info("artifact %s not read: %s", key, exc)
            return False
        self.ledger.check(key, tensors[TENSOR])
        return True

    async def delete(self, key: str) -> None:
        """Delete one key through a gateway (its siblings keep the bytes)."""
        if not self._gateway():
            return
        try:
            await self.caller.call(DeleteArtifact(key_or_id=key), self.caller.context(timeout=10.0))
        except NotFound:
            self.ledger.deleted.add(key)  # (an earlier attempt that got no answer did it)
        except TensorCastError:
            self.ledger.unsure.add(key)
        else:
            self.ledger.deleted.add(key)

    async def step(self) -> None:
        """Every other step of the seeded workload: one artifact operation (a put, a read, now and then a
        delete)."""
        roll = self.rng.random()
        keys = self.ledger.must_read()
        if roll < 0.5:
            return
        roll = (roll - 0.5) * 2
        if roll < 0.4 or not keys:
            if self.cluster.live():
                with contextlib.suppress(TensorCastError):
                    await self.put(self.new_key())
        elif roll < 0.88:
            await self.read(self.rng.choice(keys))
        else:
            await self.delete(self.rng.choice(keys))

    async def missing(self) -> list[str]:
        """The keys that must be readable and are not (each tried three times: a lost message is not a loss);
        ``InvariantBroken`` if a deleted key still is bound."""
        missing = self.ledger.must_read()
        for _ in range(3):
            missing = [k for k in missing if not await self.read(k)]
        for key in sorted(self.ledger.deleted):
            if self._gateway():
                try:
                    await self.caller.call(GetArtifact(key_or_id=key), self.caller.context(timeout=10.0))
                except NotFound:
                    continue
                except TensorCastError:
                    continue
                raise InvariantBroken(f"artifact key {key} is still bound after its delete was acknowledged")
        return missing
