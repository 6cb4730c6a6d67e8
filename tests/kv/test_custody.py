"""The hand-over rules of ``kv.custody``, table-driven: when a granted shard is served at once, which tenure a new
holder takes, whose pages a home hands over, how copies from a holder are taken, and when kept pages go."""

from __future__ import annotations

import pytest

from tensorcast.kv.custody import Copies, Custody, Tenure, backups, choose_sources, serve_at_once
from tensorcast.kv.hrw import candidates

HOMES = ["a", "b", "c", "d"]


def custody(me: str = "a", replicas: int = 1, **tenures: Tenure) -> Custody:
    c = Custody(me, keep_seconds=30.0, replicas=replicas)
    c.tenures.update({int(k[1:]): t for k, t in tenures.items()})
    return c


@pytest.mark.parametrize(("kept", "token", "want"), [
    (None, 1, True),  # the shard's first holder ever: nothing to pull
    (None, 5, False),  # held by others before: their pages first
    (Tenure(4, "a", 10.0), 5, True),  # its own lease lapsed (a store outage): nobody in between
    (Tenure(5, "a", 10.0), 5, True),  # re-granted the very lease it held (only lapsed locally)
    (Tenure(3, "a", 10.0), 5, False),  # tenure 4 was another's (or a lost grant): look for newer pages first
    (Tenure(4, "b", 10.0), 5, False),  # copies of b's tenure 4 (a backup): maybe not all of them
])
def test_a_grant_serves_at_once_only_after_its_own_tenure(kept: Tenure | None, token: int, want: bool) -> None:
    c = custody(**({"s7": kept} if kept else {}))
    assert serve_at_once(kept, token, "a") is want
    assert c.granted(7, token) == kept
    assert c.tenures[7] == Tenure(token, "a", None, served=want)  # its tenure now, served once the pages are in


@pytest.mark.parametrize(("own", "offers", "want"), [
    (0, {}, (0, [])),  # nothing anywhere
    (3, {"b": 0, "c": 0}, (3, [])),  # its own pages are the newest: nothing to pull
    (3, {"b": 4, "c": 4, "d": 2}, (4, ["b", "c"])),  # a holder and its backup keep the newest
    (4, {"b": 4}, (4, ["b"])),  # its own copies and the holder's: both (the copies may miss some)
    (2, {"b": 6}, (2, [])),  # an offer at or past the grant's own token is no predecessor (token 6 here)
    (0, {"b": 3, "c": 5}, (5, ["c"])),  # tenure 4 was a lost grant nobody served: 3 is not the newest, 5 is
])
def test_the_newest_tenure_on_offer_is_taken(own: int, offers: dict[str, int], want: tuple[int, list[str]]) -> None:
    assert choose_sources(own, offers, token=6) == want


def test_only_the_asked_tenure_is_handed_over_and_only_when_not_served() -> None:
    c = custody(s7=Tenure(4, "a", 1.0))
    assert c.offered(7, 6) == 4 and c.hands_over(7, 6, 4)
    assert not c.hands_over(7, 6, 3) and not c.hands_over(7, 6, 0)
    assert c.offered(7, 4) == 0  # not older than the asker's
    served = custody(s7=Tenure(4, "a", None))
    assert served.offered(7, 6) == 0 and not served.hands_over(7, 6, 4)  # still served here: never handed over
    assert custody().offered(7, 6) == 0


def test_a_tenure_that_never_served_offers_the_pages_it_was_bringing_in() -> None:
    """Granted, still pulling tenure 4 from others, and stepped down: what arrived here is tenure 4's."""
    c = custody(s7=Tenure(2, "a", 1.0))
    c.granted(7, 6)
    c.pulling(7, 4)
    c.released(7, now=9.0)
    assert c.tenures[7] == Tenure(4, "", 9.0) and c.offered(7, 8) == 4
    d = custody()
    d.granted(7, 6)
    d.pulling(7, 4)
    d.served(7)
    d.released(7, now=9.0)
    assert d.offered(7, 8) == 6  # it served tenure 6: its own pages are the newest


@pytest.mark.parametrize(("kept", "token", "sender", "want", "after"), [
    (None, 4, "b", Copies.MERGE, Tenure(4, "b", 5.0)),
    (Tenure(4, "b", 1.0), 4, "b", Copies.MERGE, Tenure(4, "b", 1.0)),
    (Tenure(4, "b", 1.0), 5, "b", Copies.MERGE, Tenure(5, "b", 1.0)),  # b re-acquired its own lease
    (Tenure(4, "b", 1.0), 5, "c", Copies.REPLACE, Tenure(5, "c", 5.0)),  # c took over: b's copies are stale
    (Tenure(4, "b", 1.0), 7, "b", Copies.REPLACE, Tenure(7, "b", 5.0)),  # others held it in between
    (Tenure(4, "b", 1.0), 3, "c", Copies.REFUSE, Tenure(4, "b", 1.0)),  # a holder that lost the shard
])
def test_copies_merge_within_a_tenure_and_its_holders_next(kept: Tenure | None, token: int, sender: str,
                                                          want: Copies, after: Tenure) -> None:
    c = custody(**({"s7": kept} if kept else {}))
    assert c.copies(7, token, sender, now=5.0) is want
    assert c.tenures[7] == after


def test_released_pages_are_kept_for_the_next_holder_then_dropped() -> None:
    shard = next(s for s in range(64) if candidates(s, HOMES, 2)[:2] == ["b", "c"])
    c = custody("a")
    c.granted(shard, 3)
    assert c.to_drop([shard], [shard], HOMES, now=0.0) == []  # served
    c.released(shard, now=100.0)
    assert c.to_drop([shard], [], HOMES, now=110.0) == []  # kept for the next holder
    assert c.to_drop([shard], [], HOMES, now=131.0) == [shard]  # kept long enough
    c.dropped(shard)
    assert shard not in c.tenures


def test_a_best_ranked_home_keeps_its_pages_as_long_as_it_ranks() -> None:
    shard = next(s for s in range(64) if candidates(s, HOMES, 2)[:2] == ["a", "b"])
    lapsed = custody("a")
    lapsed.granted(shard, 3)
    lapsed.released(shard, now=0.0)  # its lease lapsed while the store was away: it is still rank 0
    assert lapsed.to_drop([shard], [], HOMES, now=1000.0) == []
    backup = custody("b", replicas=2)
    assert backup.copies(shard, 3, "a", now=0.0) is Copies.MERGE
    assert backup.to_drop([shard], [], HOMES, now=1000.0) == []  # a backup keeps its copies
    single = custody("b")
    assert single.copies(shard, 3, "a", now=0.0) is Copies.MERGE
    assert single.to_drop([shard], [], HOMES, now=1000.0) == [shard]  # not with replicas=1


def test_backups_are_the_next_best_ranked_homes_and_refilled_when_they_change() -> None:
    shard = 11
    ranked = candidates(shard, sorted(HOMES), 4)
    holder = ranked[0]
    assert backups(shard, HOMES, holder, 1) == []
    assert backups(shard, HOMES, holder, 2) == [ranked[1]]
    assert backups(shard, HOMES, holder, 3) == ranked[1:3]
    assert backups(shard, HOMES, ranked[1], 2) == [ranked[0]]  # a holder that is not rank 0 (for a while)
    c = Custody(holder, keep_seconds=30.0, replicas=2)
    c.granted(shard, 1)
    assert c.refill([shard], HOMES) == {shard: [ranked[1]]}
    assert c.refill([shard], HOMES) == {}  # filled already
    assert c.backups(shard) == (ranked[1],)
    without = [h for h in HOMES if h != ranked[1]]  # the backup died: the next one is filled
    assert c.refill([shard], without) == {shard: [ranked[2]]}
    c.released(shard, now=1.0)
    assert c.backups(shard) == ()
