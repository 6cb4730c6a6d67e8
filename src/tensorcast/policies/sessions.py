"""Sticky sessions: which instance each session is on, consulted before any router.

Owns: ``SessionTable`` (session id -> instance id, what a move rewrites) and ``StickySessions``, which routes
a session's turns to the instance it is on while that instance is alive and asks the wrapped router only for
sessions it does not place yet (or whose instance died) and, with ``spill``, for turns whose instance is
busier than the least loaded one. Pure state fed decisions; no I/O, no clock.

Does not own: the routing decision for unplaced requests (``policies.routers``) or when to move a session
(``policies.rebalancer``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from tensorcast.errors import InvalidArgument
from tensorcast.policies.routers import Request, Router, least_loaded, live, load
from tensorcast.records import InstanceInfo

__all__ = ["SessionTable", "StickySessions"]


class SessionTable:
    """Session id -> the instance its KV cache (and so its next turn) is on."""

    def __init__(self) -> None:
        self._where: dict[str, str] = {}

    def get(self, session_id: str) -> str | None:
        return self._where.get(session_id)

    def assign(self, session_id: str, instance_id: str) -> None:
        """Place (or move) ``session_id`` on ``instance_id``; its next turn goes there."""
        self._where[session_id] = instance_id

    def forget(self, session_id: str) -> None:
        """The session ended."""
        self._where.pop(session_id, None)

    def on(self, instance_id: str) -> list[str]:
        """The sessions placed on ``instance_id``."""
        return [s for s, i in self._where.items() if i == instance_id]

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._where

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(list(self._where.items()))

    def __len__(self) -> int:
        return len(self._where)


class StickySessions(Router):
    """Route a session's turns to the instance in ``table``; the wrapped ``router`` places new sessions
    (and sessions whose instance is no longer alive), and the placement is recorded. Requests without a
    session id always go to the wrapped router. The wrapped router still ``observe``s sticky turns, so a
    cache-aware index learns the session's growing prefix.

    ``spill`` (None: never): a turn also goes to the wrapped router, and its session is placed where it went,
    when the session's instance is busier than the least loaded live instance by ``least_loaded``'s measure
    (requests in flight, then KV in use) with more than ``spill`` requests to spare. Only where another
    instance can serve the turn without recomputing the session (a shared KV store): then staying put is worth
    a store read at most, and waiting behind other requests costs more. ``spill=0`` keeps a session where it
    is exactly when no instance looks less busy."""

    def __init__(self, router: Router, table: SessionTable | None = None, *, spill: int | None = None) -> None:
        if spill is not None and spill < 0:
            raise InvalidArgument(f"spill must be None or >= 0, got {spill}")
        self.router = router
        self.table = table if table is not None else SessionTable()
        self.spill = spill

    def pinned(self, request: Request, instances: Sequence[InstanceInfo]) -> str | None:
        """The live instance the request's session is on, or None (also when ``spill`` lets the turn go)."""
        where = self.table.get(request.session_id) if request.session_id else None
        if where is None:
            return None
        candidates = live(instances)
        home = next((i for i in candidates if i.instance_id == where), None)
        if home is None:
            return None
        if self.spill is not None:
            best = least_loaded(candidates)
            if (load(home) - self.spill, home.kv_tokens_used) > (load(best), best.kv_tokens_used):
                return None
        return home.instance_id

    def choose(self, request: Request, instances: Sequence[InstanceInfo]) -> str:
        where = self.pinned(request, instances)
        return where if where is not None else self.router.choose(request, instances)

    def route(self, request: Request, instances: Sequence[InstanceInfo]) -> str:
        where = self.pinned(request, instances)
        if where is not None:
            self.router.observe(request, where)
            return where
        chosen = self.router.route(request, instances)
        if request.session_id:
            self.table.assign(request.session_id, chosen)
        return chosen

    def set_topology(self, workers: Sequence[Any]) -> None:
        self.router.set_topology(workers)
