"""The holder's side of read leases: the artifact records this gateway may hand out itself, and until when.

Owns: ``HeldReads`` — a bounded table of artifact id -> (the record the store sent with the lease, when this
worker stops answering from it). The end is counted on this worker's monotonic clock from *before* it asked
(the store's lease started later), shortened by ``MARGIN`` (clock rates drift), so a holder the store could not
tell stops answering before the store gives up waiting on it (``gs.read_leases``). A revocation forgets the
record and remembers when it came: a grant whose request left before that (its reply overtaken by the
revocation) is not kept. Does not own: the decision to ask (``worker.gateway``), the places of the bytes
(``worker.store``), or the store's side.
"""

from __future__ import annotations

from collections import OrderedDict

from tensorcast import clock
from tensorcast.records import ArtifactInfo

__all__ = ["MARGIN", "HeldReads"]

# The share of a lease a holder does not use: the store's wait for an unreachable holder is the whole lease.
MARGIN = 0.1
_REMEMBER = 30.0


class HeldReads:
    """``capacity``: records kept at most (the least recently used go first: their look-ups then ask);
    ``longest``: the longest lease expected (the store's ``gs.read_lease_seconds``; a longer one seen counts)."""

    def __init__(self, capacity: int = 4096, longest: float = 0.0) -> None:
        self.capacity = capacity
        self._held: OrderedDict[str, tuple[ArtifactInfo, float]] = OrderedDict()
        # artifact id -> when its leases were last revoked (monotonic): older grants in flight are void.
        self._revoked: OrderedDict[str, float] = OrderedDict()
        self._longest = longest  # the longest lease: how long a revocation must be remembered

    def __len__(self) -> int:
        return len(self._held)

    def keep(self, info: ArtifactInfo, seconds: float, asked_at: float) -> None:
        """The store granted a lease of ``seconds`` on ``info`` to a request sent at ``asked_at``
        (``clock.monotonic()``)."""
        if seconds <= 0 or self._revoked.get(info.id, -1.0) >= asked_at:
            return
        self._longest = max(self._longest, seconds)
        self._held[info.id] = (info, asked_at + seconds * (1.0 - MARGIN))
        self._held.move_to_end(info.id)
        while len(self._held) > self.capacity:
            self._held.popitem(last=False)

    def answer(self, artifact_id: str) -> ArtifactInfo | None:
        """The record to answer a look-up of ``artifact_id`` with, while this worker's lease on it lasts."""
        got = self._held.get(artifact_id)
        if got is None:
            return None
        if clock.monotonic() >= got[1]:
            del self._held[artifact_id]
            return None
        self._held.move_to_end(artifact_id)
        return got[0]

    def revoke(self, artifact_ids: tuple[str, ...] | list[str]) -> None:
        """Stop answering for these now (and void grants still on their way)."""
        now = clock.monotonic()
        for aid in artifact_ids:
            self._held.pop(aid, None)
            self._revoked[aid] = now
            self._revoked.move_to_end(aid)
        # A revocation older than the longest lease voids no grant still in flight: forget it (kept at least
        # ``_REMEMBER`` seconds: a store may grant longer leases than this worker was told to expect).
        while self._revoked and next(iter(self._revoked.values())) < now - max(self._longest, _REMEMBER) - 1.0:
            self._revoked.popitem(last=False)
