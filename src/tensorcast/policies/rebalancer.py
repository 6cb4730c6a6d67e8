"""The TensorCast rebalancer: which idle sessions to move off the most loaded instance, and where.

Owns: the session record the rebalancer reads (``SessionInfo``), the decision it returns (``Move``) and the
policy itself (``Rebalancer.decide``), fed a clock value, the instances' signals (``list_instances()``) and
the caller's sessions; it returns moves and keeps only its own memory (when it last ticked, when each session
last moved). No sockets, files or clocks: the class is short enough to read whole, and ``docs/policies.md``
shows it.

Does not own: executing a move (``policies.moves``: one plan per move, then the session table is rewritten)
or routing turns (``policies.routers``, ``policies.sessions``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tensorcast.errors import InvalidArgument
from tensorcast.policies.routers import load
from tensorcast.records import InstanceInfo

__all__ = ["Move", "Rebalancer", "SessionInfo"]


@dataclass(frozen=True)
class SessionInfo:
    """A session as the caller knows it: where its KV cache is, how large, whether a turn is in flight, and
    the request whose KV cache holds its context (``""``: the session id names it)."""

    session_id: str
    instance_id: str
    kv_tokens: int
    busy: bool
    request_id: str = ""


@dataclass(frozen=True)
class Move:
    """Move ``session_id``'s KV cache (held by ``request_id``) from ``source`` to ``target``; decided at
    ``decided_at`` (the clock value ``decide`` was given)."""

    session_id: str
    source: str
    target: str
    kv_tokens: int
    request_id: str
    decided_at: float


class Rebalancer:
    """Every ``interval_s``, while the most and least loaded live instances differ by more than ``gap``
    sessions, move an idle session from the first to the second, at most ``max_moves_per_tick`` per tick,
    the one with the most KV first (its turns are the longest prefills). Load is the caller's sessions on an
    instance, busy or idle: an agent session is idle most of the time, so ``running + waiting`` at one tick
    misses most of the load an instance will serve, while its resident sessions are that load. A session
    mid-turn never moves, nor to an instance busier right now than its own (requests in flight, then KV in
    use: where a load-aware router would not send its turn). A move shifts one session and happens only if
    the source keeps at least as many as the target, so it can never reverse the gap that justified it; a
    moved session stays put for ``cooldown_s``. Together: no session goes back and forth."""

    def __init__(self, interval_s: float = 0.5, gap: int = 1, max_moves_per_tick: int = 2,
                 cooldown_s: float = 60.0) -> None:
        if interval_s < 0 or gap < 0 or max_moves_per_tick < 1 or cooldown_s < 0:
            raise InvalidArgument(f"bad rebalancer settings: interval_s={interval_s}, gap={gap}, "
                                  f"max_moves_per_tick={max_moves_per_tick}, cooldown_s={cooldown_s}")
        self.interval_s, self.gap = interval_s, gap
        self.max_moves_per_tick, self.cooldown_s = max_moves_per_tick, cooldown_s
        self.next_tick = -math.inf
        self.moved_at: dict[str, float] = {}  # session -> when it last moved (within its cooldown)

    def decide(self, now: float, instances: Sequence[InstanceInfo],
               sessions: Sequence[SessionInfo]) -> list[Move]:
        if now < self.next_tick:
            return []
        self.next_tick = now + self.interval_s
        self.moved_at = {s: t for s, t in self.moved_at.items() if now < t + self.cooldown_s}
        now_busy = {i.instance_id: (load(i), i.kv_tokens_used) for i in instances if i.alive}
        loads = dict.fromkeys(now_busy, 0)
        for s in sessions:
            if s.instance_id in loads:
                loads[s.instance_id] += 1
        room = {i.instance_id: i.kv_tokens_capacity - i.kv_tokens_used if i.kv_tokens_capacity else math.inf
                for i in instances}
        idle = sorted((s for s in sessions if not s.busy and s.session_id not in self.moved_at),
                      key=lambda s: (-s.kv_tokens, s.session_id))
        moves: list[Move] = []
        while len(moves) < self.max_moves_per_tick and len(loads) > 1:
            src, dst = max(loads, key=loads.__getitem__), min(loads, key=loads.__getitem__)
            # Would the move invert the imbalance, or send the session where its turn would wait longer?
            if (loads[src] - loads[dst] <= self.gap or loads[src] - 1 < loads[dst] + 1
                    or now_busy[dst] > now_busy[src]):
                break
            pick = next((s for s in idle if s.instance_id == src and s.kv_tokens <= room[dst]), None)
            if pick is None:
                break
            idle.remove(pick)
            loads[src], loads[dst], room[dst] = loads[src] - 1, loads[dst] + 1, room[dst] - pick.kv_tokens
            self.moved_at[pick.session_id] = now
            moves.append(Move(pick.session_id, src, dst, pick.kv_tokens, pick.request_id or pick.session_id, now))
        return moves
