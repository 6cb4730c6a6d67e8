"""The leases a shard home serves under, and the fencing check every page request passes.

Owns: which held shards are served (held, and not being received from another home), the token check of a
request's keys against them — in one step in the common case (every token the request carries is the current
one of a served shard, and none has expired), shard by shard otherwise (``kv.leases.HomeLeases.check``) — the
key checks of a decoded request, and publishing the served leases (token, serve-until) to the store's presence
table whenever they change, so that same-host readers vouch only within the same serve-until.
Does not own: acquiring, renewing or releasing the leases (``kv.home``), the rule a lease is served under
(``kv.leases``), or the page requests themselves (``kv.serving``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tensorcast import clock
from tensorcast.errors import InvalidArgument, StaleFencingToken
from tensorcast.kv.keys import MAX_KEY_BYTES, check_keys, shards_of
from tensorcast.kv.leases import HomeLeases
from tensorcast.kv.pages import PageStore

__all__ = ["ServedLeases"]


def _check_keys(keys: Sequence[str]) -> None:
    """``check_keys`` of a decoded request, whose keys are ``str`` already: the full check only when a key
    may be empty or too long."""
    if "" in keys or max(map(len, keys), default=0) > MAX_KEY_BYTES // 4:
        check_keys(keys)


class ServedLeases:
    """The shards of ``leases`` as served: ``changed`` after every change of the leases or of ``receiving``,
    ``check`` for every page request, ``token`` of a shard."""

    def __init__(self, leases: HomeLeases, store: PageStore, num_shards: Callable[[], int]) -> None:
        self.leases = leases
        self.store = store
        self.num_shards = num_shards
        self.receiving: set[int] = set()  # held shards whose pages are being pulled: not served yet
        # The leases as served, for checking a request's tokens in one step: shard -> token of every held
        # shard that is served, and the earliest local expiry among them. Rebuilt whenever a lease changes.
        self._live: dict[int, int] = {}
        self._live_until = 0.0

    def token(self, shard: int) -> int:
        """The token ``shard`` is served under here (0: not served here)."""
        held = self.leases.held.get(shard)
        if held is None or shard in self.receiving or clock.monotonic() >= held.local_expiry:
            return 0
        return held.token

    def serves(self, shard: int) -> bool:
        """Whether ``shard`` was served as of the last change (its local expiry aside)."""
        return shard in self._live

    def changed(self) -> None:
        held = self.leases.held
        served = {s: h for s, h in held.items() if s not in self.receiving}
        self._live = {s: h.token for s, h in served.items()}
        self._live_until = min((h.local_expiry for h in served.values()), default=0.0)
        if self.store.presence is not None:  # same-host readers vouch only within the same serve-until
            self.store.presence.publish_leases({s: (h.token, h.local_expiry) for s, h in served.items()},
                                               self.num_shards(), clock.monotonic())

    def check(self, keys: tuple[str, ...], tokens: dict[int, int]) -> list[int]:
        """The shard of every key, once the request's token for each of them is checked against a live
        local lease. In one step when every token the request carries is the current one of a lease held
        and no lease has expired (the common case); otherwise shard by shard, which also steps down from
        a shard a request shows a newer token for."""
        num_shards = self.num_shards()
        if not num_shards:
            raise StaleFencingToken("this shard home has no lease table yet")
        _check_keys(keys)
        shards = shards_of(keys, num_shards)
        now = clock.monotonic()
        need = set(shards)
        if now < self._live_until and need <= tokens.keys() and tokens.items() <= self._live.items():
            return shards
        for shard in need:
            token = tokens.get(shard)
            if token is None:
                raise InvalidArgument(f"no fencing token for shard {shard}")
            self.leases.check(shard, token, now)
            if shard in self.receiving:
                raise StaleFencingToken(f"shard {shard} is being handed over to this home: retry")
        return shards
