"""Which KV pages are present: the caller's side of ``client.kv.exists`` and ``present``.

Owns: answering a batch of lookups, first from the presence tables of same-host shard homes
(``client.kv_local.LocalPresence``: keys they vouch for cost no round trip), then one ``KVExists`` per home
for the others; the prefix semantics of ``exists`` (keys after a known miss are not asked about); learning a
same-host home's presence table from its reply; and counting the requests sent. Does not own: routing and
retries (``client.kv_route``), the presence tables themselves (``kv.presence``), or reading and writing
pages (``client.kv``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tensorcast.client.kv_local import LocalPresence
from tensorcast.client.kv_route import KVRouter
from tensorcast.config import KVConfig
from tensorcast.errors import InvalidArgument
from tensorcast.wire.caller import Caller
from tensorcast.wire.kv_messages import KVExists

__all__ = ["KVLookups"]


class KVLookups:
    """``requests`` counts the ``KVExists`` requests sent (the lookups the presence tables could not answer)."""

    def __init__(self, caller: Caller, config: KVConfig, route: KVRouter, presence: LocalPresence) -> None:
        self.caller = caller
        self.config = config
        self.route = route
        self.presence = presence
        self.requests = 0

    async def exists(self, keys: Sequence[str]) -> int:
        """How many leading keys are present (prefix semantics: stop at the first miss)."""
        flags = await self._flags(keys, prefix=True)
        n = flags.find(0)
        return len(keys) if n < 0 else n

    async def present(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is present: every key answered, no prefix semantics."""
        return list(map(bool, await self._flags(keys, prefix=False)))

    async def _flags(self, keys: Sequence[str], *, prefix: bool) -> bytearray:
        """One byte per key, 1 when present: from same-host presence tables where they vouch, else asked. With
        ``prefix``, keys after a miss the tables vouched for are left 0, unasked."""
        local = self.presence.flags(keys)
        if local is None:
            flags = bytearray(len(keys))
            await self._ask(keys, list(range(len(keys))), flags)
            return flags
        present, vouched = local
        flags = bytearray(present.view(np.uint8).tobytes())
        todo = ~vouched
        if prefix:
            misses = np.flatnonzero(vouched & ~present)
            if misses.size:  # nothing after a known miss counts
                todo[misses[0] :] = False
        ask = np.flatnonzero(todo).tolist()
        if ask:
            await self._ask(keys, ask, flags)
        return flags

    async def _ask(self, keys: Sequence[str], ask: list[int], flags: bytearray) -> None:
        """``flags[i]`` for each ``i`` of ``ask``, from the homes of those keys (one KVExists per home). A same-
        host home's reply names its presence table, which answers the next lookups here. Keys whose shards
        stayed without a home are misses."""
        sub = keys if len(ask) == len(keys) else [keys[i] for i in ask]

        async def probe(address: str, idx: list[int], tokens: dict[int, int]) -> None:
            ks = tuple(sub) if len(idx) == len(sub) else tuple(sub[j] for j in idx)
            self.requests += 1
            reply = await self.caller.call(KVExists(keys=ks, tokens=tokens), self.route.ctx(), address=address)
            if len(reply.present) != len(idx):
                raise InvalidArgument(f"{address} answered {len(reply.present)} flags for {len(idx)} keys")
            if reply.presence and self.config.same_host_exists and self.route.local(address):
                self.presence.learn(address, reply.presence)
            if len(idx) == len(keys):  # one home answered for every key, in order
                flags[:] = reply.present
            else:
                for j, flag in zip(idx, reply.present, strict=True):
                    flags[ask[j]] = flag

        await self.route.run(sub, probe, need_all=False)
