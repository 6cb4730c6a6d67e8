"""The reference rules (``gs.refs``), table-driven: merging a put onto a reference, liveness and ownership,
what removing or renewing one reference does, records from before key references, the listing cursor."""

from __future__ import annotations

import pytest

from tensorcast.gs.refs import (
    References,
    legacy,
    list_cursor,
    merge_lease,
    parse_cursor,
    renew_outcome,
    unbind_outcome,
)

NOW = 100.0
# A permanent key "p", a key "l" leased until 150, a key "x" whose lease ended at 50.
MIXED = References((("l", 150.0), ("p", None), ("x", 50.0)))
LEASED = References((("l", 150.0),), anonymous=True, anon_expiry=120.0)
HELD = References(anonymous=True)  # a put without a key and without a ttl
ENDED = References((("x", 50.0),), anonymous=True, anon_expiry=60.0)


@pytest.mark.parametrize(("existing", "new", "merged"), [
    (False, 10.0, 10.0), (False, None, None),  # no reference yet: the put's
    (10.0, 20.0, 20.0), (20.0, 10.0, 20.0),  # two leases: the later
    (None, 10.0, None), (10.0, None, None), (None, None, None),  # permanence wins
])
def test_merge_lease(existing: float | bool | None, new: float | None, merged: float | None) -> None:
    assert merge_lease(existing, new) == merged


@pytest.mark.parametrize(("refs", "alive", "keys", "ownership"), [
    (MIXED, True, ("l", "p"), ("system", None)),
    (LEASED, True, ("l",), ("lease", 150.0)),
    (HELD, True, (), ("system", None)),
    (ENDED, False, (), ("lease", NOW)),
    (References(), False, (), ("lease", NOW)),
])
def test_liveness_and_ownership(refs: References, alive: bool, keys: tuple[str, ...],
                                ownership: tuple[str, float | None]) -> None:
    assert refs.alive(NOW) is alive and refs.live_keys(NOW) == keys and refs.ownership(NOW) == ownership


@pytest.mark.parametrize(("refs", "key", "expired_only", "outcome"), [
    (MIXED, "l", False, "unbind"),  # "p" keeps it
    (MIXED, "p", False, "unbind"),  # "l" keeps it
    (MIXED, "q", False, "missing"),
    (MIXED, None, False, "missing"),  # no anonymous reference
    (MIXED, "x", True, "unbind"),  # the reaper: an ended lease goes, the rest keeps it
    (MIXED, "l", True, "kept"),  # the reaper never removes a live lease (one renewed since it was listed)
    (LEASED, "l", False, "unbind"),  # the anonymous lease keeps it
    (LEASED, None, False, "unbind"),
    (References((("l", 150.0),)), "l", False, "delete"),  # the last reference
    (References((("a", None), ("x", 50.0))), "a", False, "delete"),  # only an ended lease is left
    (HELD, None, False, "delete"),
    (ENDED, None, True, "delete"),
])
def test_unbind_outcome(refs: References, key: str | None, expired_only: bool, outcome: str) -> None:
    assert unbind_outcome(refs, key, NOW, expired_only) == outcome


@pytest.mark.parametrize(("refs", "key", "outcome"), [
    (MIXED, "l", "ok"), (MIXED, "p", "permanent"), (MIXED, "x", "missing"), (MIXED, "q", "missing"),
    (MIXED, None, "missing"), (LEASED, None, "ok"), (HELD, None, "permanent"), (ENDED, None, "missing"),
])
def test_renew_outcome(refs: References, key: str | None, outcome: str) -> None:
    assert renew_outcome(refs, key, NOW) == outcome


def test_references_without_one() -> None:
    assert MIXED.without("p") == References((("l", 150.0), ("x", 50.0)))
    assert LEASED.without(None) == References((("l", 150.0),))
    assert LEASED.has(None) and not MIXED.has(None) and MIXED.has("x") and MIXED.expiry("l") == 150.0


def test_records_from_before_key_references() -> None:
    """One ownership covered the artifact: its keys inherit it; without keys, it is the anonymous reference."""
    assert legacy(50.0, ["b", "a"]) == References((("a", 50.0), ("b", 50.0)))
    assert legacy(None, []) == References(anonymous=True, anon_expiry=None)
    assert legacy(50.0, []) == References(anonymous=True, anon_expiry=50.0)


def test_listing_cursor() -> None:
    assert parse_cursor(list_cursor("m@v1", "tc-x")) == ("k", "m@v1")
    assert parse_cursor(list_cursor(None, "tc-x")) == ("a", "tc-x")
    assert parse_cursor("") == ("", "") and parse_cursor("?junk") == ("", "")
