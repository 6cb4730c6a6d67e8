"""One binding's swap state as a pure state machine: the active version, the staged swap, compare-and-swap.

Owns: what a binding may do when asked to prepare, activate or abort a swap (identified by a swap id):
- **prepare** checks the compare-and-swap (``expected``: the version that must be active; None: no check;
  0: nothing active yet), is a no-op for the version already active (a retried swap), is idempotent for the
  swap already staged, refuses a swap id that was aborted here (a late or repeated prepare after the group
  gave up), and replaces a staged swap of another id (its coordinator gave up on it);
- **activate** applies only the staged swap it names, checks the compare-and-swap again, and is a no-op for
  the swap it last activated (a retried activation);
- **abort** drops the staged swap (if it is the one named) and remembers the id;
- a staged swap nobody decided on expires after ``staging_ttl`` seconds (its staging is freed).
Fed the clock; returns decisions and raises typed errors (``VersionConflict``, ``SwapAborted``). Does not
own: fetching, copying or leases (``client.binding``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from tensorcast.errors import SwapAborted, VersionConflict, clip

__all__ = ["NOOP", "PREPARE", "READY", "Staged", "SwapState"]

NOOP, PREPARE, READY = "noop", "prepare", "ready"
_REMEMBER = 256  # aborted swap ids remembered (late prepares of older ones are unlikely to matter)


@dataclass(frozen=True)
class Staged:
    swap_id: str
    version: int
    expires: float


@dataclass
class SwapState:
    staging_ttl: float = 600.0
    active: int = 0  # 0: nothing active yet (or unknown after a failed activation)
    staged: Staged | None = None
    last_activated: str = ""
    aborted: OrderedDict[str, None] = field(default_factory=OrderedDict)

    def _check_cas(self, expected: int | None, version: int) -> None:
        if expected is not None and self.active != expected:
            raise VersionConflict(f"swap to version {version} expected version {expected} active, but version "
                                  f"{self.active or 'none'} is")

    def begin_prepare(self, swap_id: str, version: int, expected: int | None, now: float) -> str:
        """NOOP (``version`` is already active), READY (this swap is already staged) or PREPARE (fetch it)."""
        self.expire(now)
        if swap_id in self.aborted:
            raise SwapAborted(f"swap {clip(swap_id)} was aborted on this binding")
        if version == self.active:
            return NOOP
        self._check_cas(expected, version)
        if self.staged is not None and self.staged.swap_id == swap_id and self.staged.version == version:
            return READY
        return PREPARE

    def prepared(self, swap_id: str, version: int, now: float) -> Staged | None:
        """Record a finished prepare; returns the staged swap it replaces (to free), if any."""
        if swap_id in self.aborted:
            raise SwapAborted(f"swap {clip(swap_id)} was aborted while it was being prepared")
        replaced = self.staged if self.staged is not None and self.staged.swap_id != swap_id else None
        self.staged = Staged(swap_id, version, now + self.staging_ttl)
        return replaced

    def begin_activate(self, swap_id: str, expected: int | None, now: float) -> Staged | None:
        """The staged swap to apply now, or None when ``swap_id`` was already activated (a retry)."""
        if swap_id and swap_id == self.last_activated and (self.staged is None or self.staged.swap_id != swap_id):
            return None
        expired = self.expire(now)
        staged = self.staged
        if staged is None or (swap_id and staged.swap_id != swap_id):
            why = "expired" if expired is not None and expired.swap_id == swap_id else \
                "aborted" if swap_id in self.aborted else "not staged"
            raise SwapAborted(f"swap {clip(swap_id or '(any)')} is {why} on this binding: nothing to activate")
        self._check_cas(expected, staged.version)
        return staged

    def activated(self, staged: Staged) -> None:
        self.active = staged.version
        self.last_activated = staged.swap_id
        self.staged = None

    def activation_failed(self) -> None:
        """An activation stopped midway: the bound tensors hold a mix; nothing counts as active."""
        self.active = 0
        self.staged = None

    def abort(self, swap_id: str) -> Staged | None:
        """Abort ``swap_id`` ("" = whatever is staged); returns the staged swap to free, if any."""
        if swap_id:
            self.aborted[swap_id] = None
            while len(self.aborted) > _REMEMBER:
                self.aborted.popitem(last=False)
        staged = self.staged
        if staged is not None and (not swap_id or staged.swap_id == swap_id):
            self.staged = None
            return staged
        return None

    def expire(self, now: float) -> Staged | None:
        """Drop a staged swap whose decision never came; returns it (to free)."""
        staged = self.staged
        if staged is not None and staged.expires <= now:
            self.staged = None
            return staged
        return None
