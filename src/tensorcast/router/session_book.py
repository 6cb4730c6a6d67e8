"""The sessions a router replica has seen, and the rebalancer's moves among them (pure: the clock passed in).

Owns: ``SessionBook``: for each session, the backend its last request went to, the size of its context (the
last prompt's length: tokens, or characters of a text prompt), whether a request of it is in flight and when it
was last seen, and each backend's resident context (its sessions' tokens: the load an agent's sessions bring a
backend between their turns, which requests in flight do not show); sessions idle longer than ``ttl_s`` are
forgotten and at most ``max_sessions`` are kept (the
least recently seen go first), so a long-running router holds bounded state. ``rebalance`` hands the book to a
``policies.Rebalancer`` (which sessions to move off the most loaded backend) and records its moves as
overrides: a moved session's requests go to its new backend while that backend is up, whatever the routing
policy would say. With engines that keep KV pages in the pool (``TensorCastConnector``) the session's cache
follows it: the new backend loads the pages the old one stored on its next turn. Does not own: HTTP, routing
policies or the rebalancing policy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tensorcast.policies import Move, Rebalancer, SessionInfo
from tensorcast.records import InstanceInfo

__all__ = ["SessionBook"]


@dataclass(slots=True)
class _Session:
    backend: str
    context: int
    in_flight: int
    seen: float


class SessionBook:
    def __init__(self, rebalancer: Rebalancer | None = None, *, ttl_s: float = 600.0,
                 max_sessions: int = 100_000) -> None:
        self.rebalancer = rebalancer
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # least recently seen first
        self.moved: dict[str, str] = {}  # session -> the backend a move put it on
        self.moves = 0
        self.resident: dict[str, int] = {}  # backend -> the contexts of the sessions on it (tokens)

    def override(self, session_id: str, alive: Sequence[InstanceInfo]) -> str | None:
        """The backend a move put this session on, while it is up."""
        target = self.moved.get(session_id) if session_id else None
        return target if target is not None and any(i.instance_id == target for i in alive) else None

    def started(self, now: float, session_id: str, backend: str, context: int) -> None:
        if not session_id:
            return
        self.expire(now)  # the idle ones leave here too: with or without a rebalancer ticking
        s = self._sessions.pop(session_id, None)
        if s is None:
            s = _Session(backend, 0, 0, now)
        self._place(s, backend, context)
        s.seen = now
        s.in_flight += 1
        self._sessions[session_id] = s
        while len(self._sessions) > self.max_sessions:
            self._forget(*self._sessions.popitem(last=False))

    def _place(self, s: _Session, backend: str, context: int) -> None:
        self.resident[s.backend] = self.resident.get(s.backend, 0) - s.context
        s.backend, s.context = backend, context
        self.resident[backend] = self.resident.get(backend, 0) + context

    def _forget(self, session_id: str, s: _Session) -> None:
        self.resident[s.backend] -= s.context
        self.moved.pop(session_id, None)

    def finished(self, now: float, session_id: str) -> None:
        s = self._sessions.get(session_id) if session_id else None
        if s is not None:
            s.in_flight = max(0, s.in_flight - 1)
            s.seen = now

    def expire(self, now: float) -> None:
        while self._sessions:
            session_id, s = next(iter(self._sessions.items()))
            if s.in_flight or now - s.seen < self.ttl_s:
                return
            self._forget(session_id, self._sessions.pop(session_id))

    def rebalance(self, now: float, instances: Sequence[InstanceInfo]) -> list[Move]:
        """The rebalancer's moves now (none without one), recorded as overrides."""
        self.expire(now)
        if self.rebalancer is None:
            return []
        sessions = [SessionInfo(sid, s.backend, s.context, s.in_flight > 0) for sid, s in self._sessions.items()]
        moves = self.rebalancer.decide(now, instances, sessions)
        for m in moves:
            self.moved[m.session_id] = m.target
            s = self._sessions[m.session_id]
            self._place(s, m.target, s.context)
        self.moves += len(moves)
        return moves

    def __len__(self) -> int:
        return len(self._sessions)
