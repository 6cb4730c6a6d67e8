"""What keeps an artifact in the store: its references, and the pure rules every backend applies to them.

Owns: ``References`` — an artifact's key bindings (each permanent, or leased until an expiry) and its
anonymous reference (what puts without a key left: a system hold when one had no ``ttl``, else a caller lease)
— with liveness and ownership as of a clock passed in; ``merge_lease`` (a put onto an existing reference);
``unbind_outcome`` and ``renew_outcome`` (what removing or renewing one reference does); the listing cursor;
and how a record written before references existed reads (``legacy``). Does not own: storing references
(``gs.sqlite``, ``gs.etcd``) or the RPC surface (``gs.service``, ``gs.artifacts``).

Keys are independent names: deleting one key removes that reference only, and an artifact's record, replicas
and bytes go when no live reference remains. Pins (a worker keeping a replica resident) are placement, not
references: they keep no artifact.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Literal

__all__ = ["References", "legacy", "list_cursor", "live", "merge_lease", "parse_cursor", "renew_outcome",
           "unbind_outcome"]

Unbinding = Literal["missing", "kept", "unbind", "delete"]
Renewal = Literal["ok", "missing", "permanent"]


def merge_lease(existing: float | bool | None, new: float | None) -> float | None:
    """A reference after a put onto it. ``existing`` is False when there was none (the put makes it).

    Permanence (None) always wins: a lease never downgrades a permanent reference, and a put without a ttl
    makes a leased one permanent. Two leases keep the later expiry."""
    if existing is False:
        return new
    if existing is None or new is None:
        return None
    assert isinstance(existing, float | int)
    return max(float(existing), new)


def live(expiry: float | None, now: float) -> bool:
    """A reference counts until its lease ends (a permanent one, None, always)."""
    return expiry is None or expiry > now


@dataclass(frozen=True, slots=True)
class References:
    """An artifact's references: ``bindings`` (key, expiry or None) in key order, and the anonymous one."""

    bindings: tuple[tuple[str, float | None], ...] = ()
    anonymous: bool = False
    anon_expiry: float | None = None  # with ``anonymous``: None is a system hold

    def has(self, key: str | None) -> bool:
        return self.anonymous if key is None else any(k == key for k, _ in self.bindings)

    def expiry(self, key: str | None) -> float | None:
        """The expiry of the reference ``key`` names (None: the anonymous one); it must exist (``has``)."""
        if key is None:
            return self.anon_expiry
        return next(e for k, e in self.bindings if k == key)

    def without(self, key: str | None) -> References:
        if key is None:
            return replace(self, anonymous=False, anon_expiry=None)
        return replace(self, bindings=tuple((k, e) for k, e in self.bindings if k != key))

    def live_keys(self, now: float) -> tuple[str, ...]:
        return tuple(k for k, e in self.bindings if live(e, now))

    def _expiries(self, now: float) -> list[float | None]:
        out = [e for _, e in self.bindings if live(e, now)]
        return [*out, self.anon_expiry] if self.anonymous and live(self.anon_expiry, now) else out

    def alive(self, now: float) -> bool:
        """Some reference still counts: the artifact exists for readers."""
        return bool(self._expiries(now))

    def ownership(self, now: float) -> tuple[Literal["system", "lease"], float | None]:
        """"system" when any live reference is permanent, else "lease" with the latest expiry (an artifact
        with no live reference reads as a lease that ended: ``alive`` says whether it exists)."""
        expiries = self._expiries(now)
        if any(e is None for e in expiries):
            return "system", None
        return "lease", max((e for e in expiries if e is not None), default=now)


def unbind_outcome(refs: References, key: str | None, now: float, expired_only: bool = False) -> Unbinding:
    """What removing reference ``key`` (None: the anonymous one) does: "missing" (there is none), "kept"
    (``expired_only`` and its lease has not ended: nothing changes), "unbind" (other live references keep
    the artifact: only this one goes), or "delete" (nothing else keeps it: the artifact goes)."""
    if not refs.has(key):
        return "missing"
    if expired_only and live(refs.expiry(key), now):
        return "kept"
    return "unbind" if refs.without(key).alive(now) else "delete"


def renew_outcome(refs: References, key: str | None, now: float) -> Renewal:
    """Whether reference ``key`` (None: the anonymous one) can take a new expiry: "missing" (there is none,
    or its lease ended already), "permanent" (it has no lease), or "ok"."""
    if not refs.has(key) or not live(refs.expiry(key), now):
        return "missing"
    return "permanent" if refs.expiry(key) is None else "ok"


def legacy(lease_expiry: float | None, keys: Iterable[str]) -> References:
    """The references of a record written before keys were references, when one ownership (``lease_expiry``)
    covered the whole artifact: each key binding inherits it, and an artifact without keys holds it as its
    anonymous reference (so deleting every key still deletes what deleting any key deleted before)."""
    bindings = tuple((k, lease_expiry) for k in sorted(keys))
    if bindings:
        return References(bindings)
    return References(anonymous=True, anon_expiry=lease_expiry)


def list_cursor(key: str | None, artifact_id: str) -> str:
    """The cursor after a listing entry: keys are listed first, in key order, then artifacts without a key
    (no prefix only), by id."""
    return "k" + key if key is not None else "a" + artifact_id


def parse_cursor(cursor: str) -> tuple[str, str]:
    """("k", last key) or ("a", last id); ("", "") to start (an unknown cursor starts over)."""
    if cursor[:1] in ("k", "a"):
        return cursor[:1], cursor[1:]
    return "", ""
