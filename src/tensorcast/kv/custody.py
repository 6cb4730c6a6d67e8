"""Which KV pages a shard home keeps beside the shards it serves, whose they are, and where a shard it was
granted gets its pages from: the hand-over rules, pure (events and a clock value in, decisions out; no I/O).

A home's page store may hold pages of shards it does not serve: shards it gave back or lost (a better-ranked
home joined, its lease lapsed while the global store was unreachable) and shards it backs up
(``kv.replicas`` > 1). Such pages are never served — every request is fenced by a live lease — but they are
what makes a hand-over lossless. Each shard's pages here are from one **tenure**: the fencing token they
were stored under (its own lease's, or the holder's that copied them here) and that holder. Tokens grow with
every grant that is not an extension, so the newest tenure is the one whose pages are the shard's latest.
A grant whose reply was lost is a tenure that served nothing (its holder never learned of it): which is why
the newest tenure *that homes keep pages of* is looked for, not the token just before the new one.

- **Granted a shard under T**: pages of this home's own tenure ``T`` or ``T - 1`` are current (its lease only
  lapsed: nobody held the shard in between, as after a global-store outage): it serves at once. Otherwise it
  asks every other recent home which tenure of the shard it keeps (``offered``), and takes the newest one on
  offer — its own, or that of the homes offering it (``choose_sources``) — before serving. Its own pages go
  first when they are older: a page put again since may have other bytes, and a read returns the latest.
- **Copies from a holder** (backups): copies of the kept tenure, or of the next one from the same holder (it
  re-acquired its own lease), are merged; a newer tenure replaces the kept pages; an older one is refused.
- **Stopped serving a shard**: its pages are kept for ``keep_seconds`` (for the next holder to pull), or for as
  long as this home is one of the shard's ``replicas`` best-ranked live homes; then dropped. A pull by the
  new holder hands them over earlier.

Does not own: the leases (``kv.leases``), the page bytes (``kv.pages``) or the requests (``kv.home``,
``kv.handover``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from tensorcast.kv.hrw import candidates

__all__ = ["Copies", "Custody", "Tenure", "backups", "choose_sources", "serve_at_once"]


def backups(shard: int, homes: Sequence[str], holder: str, replicas: int) -> list[str]:
    """The homes other than ``holder`` that keep copies of ``shard``'s pages: its next ``replicas - 1``
    best-ranked live homes (HRW over the same ``homes`` every home uses)."""
    if replicas <= 1:
        return []
    ranked = candidates(shard, sorted(set(homes)), replicas)
    return [h for h in ranked if h != holder][: replicas - 1]


def serve_at_once(kept: Tenure | None, token: int, me: str) -> bool:
    """Whether a home granted a shard under ``token``, keeping ``kept`` of it, may serve it at once: the shard's
    first tenure ever, or its own tenure continued (``token`` or ``token - 1``: nobody held it in between)."""
    if kept is None:
        return token <= 1
    return kept.holder == me and kept.token in (token, token - 1)


def choose_sources(own: int, offers: Mapping[str, int], token: int) -> tuple[int, list[str]]:
    """The newest tenure before ``token`` that anyone keeps pages of — this home (``own``, 0: none) or the
    peers' ``offers`` (peer -> tenure, 0: none) — and the peers to pull it from (all that keep it: a holder
    and its backups). This home keeps its own pages only when they are of that tenure."""
    best = max([t for t in (own, *offers.values()) if 0 < t < token], default=0)
    return best, sorted(p for p, t in offers.items() if best and t == best)


class Copies(enum.Enum):
    MERGE = "merge"
    REPLACE = "replace"  # drop the kept pages first: the copies are of a newer tenure
    REFUSE = "refuse"  # the sender's tenure is older than the pages kept here


@dataclass
class Tenure:
    token: int  # the fencing token the pages were stored under
    holder: str  # who held the shard then (this home, or the holder that copied them here)
    since: float | None = None  # when this home started keeping them without serving (None: served here)
    served: bool = True  # False: granted here, its pages still arriving (they are copies of ``source``)
    source: int = 0  # while not served: the tenure the pages here are of (kept or being pulled; 0: none)


@dataclass
class Custody:
    """One home's record of the tenure of each shard's pages it has."""

    worker_id: str
    keep_seconds: float
    replicas: int = 1
    tenures: dict[int, Tenure] = field(default_factory=dict)
    backups_of: dict[int, tuple[str, ...]] = field(default_factory=dict)  # served shard -> backups filled

    def granted(self, shard: int, token: int) -> Tenure | None:
        """A lease on ``shard`` under ``token`` was acquired: the tenure this home kept of it before, if any. The
        new tenure serves at once (``serve_at_once``) or once ``pulling`` and ``served`` say so."""
        kept = self.tenures.get(shard)
        self.tenures[shard] = Tenure(token, self.worker_id, served=serve_at_once(kept, token, self.worker_id))
        self.backups_of.pop(shard, None)  # a new tenure: its backups are filled again
        return kept

    def pulling(self, shard: int, source: int) -> None:
        """The pages of tenure ``source`` are what this home has of ``shard`` and brings in now."""
        kept = self.tenures.get(shard)
        if kept is not None and not kept.served:
            kept.source = source

    def served(self, shard: int) -> None:
        """The pages are in: the tenure this home holds is served."""
        kept = self.tenures.get(shard)
        if kept is not None:
            kept.served = True

    def released(self, shard: int, now: float) -> None:
        """This home stopped serving ``shard`` (gave it back, lost it, or its lease lapsed). A tenure that never
        served (its pull had not ended) stored nothing of its own: the pages here are of the tenure they came
        from, and are offered as that one (with whatever of them arrived)."""
        kept = self.tenures.get(shard)
        if kept is not None and not kept.served:
            self.tenures[shard] = kept = Tenure(kept.source, "", now)
        if kept is not None and kept.since is None:
            kept.since = now
        self.backups_of.pop(shard, None)

    def copies(self, shard: int, token: int, holder: str, now: float) -> Copies:
        """Copies of ``shard``'s pages arrive from ``holder`` under its ``token`` (this home does not serve it)."""
        kept = self.tenures.get(shard)
        if kept is not None and token < kept.token:
            return Copies.REFUSE
        if kept is not None and (token == kept.token or (token == kept.token + 1 and holder == kept.holder)):
            kept.token, kept.holder = token, holder
            return Copies.MERGE
        self.tenures[shard] = Tenure(token, holder, now)
        return Copies.MERGE if kept is None else Copies.REPLACE

    def offered(self, shard: int, token: int) -> int:
        """The tenure of the pages kept here (not served) of ``shard`` that a holder of ``token`` may take (0:
        none)."""
        kept = self.tenures.get(shard)
        return kept.token if kept is not None and kept.since is not None and kept.token < token else 0

    def hands_over(self, shard: int, token: int, tenure: int) -> bool:
        """Whether this home's pages of ``shard`` go to the holder of ``token`` who asked for ``tenure``."""
        return bool(tenure) and self.offered(shard, token) == tenure

    def to_drop(self, stored: Iterable[int], served: Iterable[int], homes: Sequence[str], now: float) -> list[int]:
        """The shards among ``stored`` (those with pages here) whose pages go now: not ``served``, kept for
        ``keep_seconds`` already, by a home that is not one of the shard's ``replicas`` best-ranked live
        ``homes`` (which keeps them: it is a backup, or about to hold the shard again)."""
        served = set(served)
        ranked = sorted(set(homes))
        out = []
        for shard in stored:
            if shard in served:
                continue
            kept = self.tenures.setdefault(shard, Tenure(0, "", now))
            if kept.since is None:
                kept.since = now
            if now - kept.since >= self.keep_seconds and \
                    self.worker_id not in candidates(shard, ranked, max(self.replicas, 1)):
                out.append(shard)
        return out

    def dropped(self, shard: int) -> None:
        kept = self.tenures.get(shard)
        if kept is not None and kept.since is not None:
            del self.tenures[shard]

    def refill(self, served: Iterable[int], homes: Sequence[str]) -> dict[int, list[str]]:
        """For each served shard, the backups that do not have its pages yet (the set changed: a home joined,
        died or drained, or a new tenure began); recorded as filled (the caller copies the shard's pages,
        and each new page as it is stored)."""
        out: dict[int, list[str]] = {}
        for shard in served:
            want = tuple(backups(shard, homes, self.worker_id, self.replicas))
            have = self.backups_of.get(shard, ())
            new = [h for h in want if h not in have]
            if new:
                out[shard] = new
            self.backups_of[shard] = want
        return out

    def backups(self, shard: int) -> tuple[str, ...]:
        """Where each page newly stored on served ``shard`` is copied."""
        return self.backups_of.get(shard, ())
