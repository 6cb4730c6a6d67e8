"""Running an experiment: sessions issue turns, the policy objects route them and move sessions, records out.

Owns: ``Policy`` (a router, whether the instances share a KV store, an optional rebalancer), the two ways
sessions arrive (``ClosedLoop``: a fixed number of concurrent agent sessions, each slot starting a new session
when its last one ends, until a horizon — how the paper keeps concurrent sessions as traffic; ``Replay``:
given sessions at their recorded arrival times), and ``simulate``, which drives them through a ``SimCluster``.

The policy classes run unchanged: every turn is routed by ``policy.router.route(Request(session, prompt),
cluster.list_instances())``; with a rebalancer, every ``interval_s`` of simulated time
``rebalancer.decide(now, cluster.list_instances(), sessions)`` is called with a ``SessionInfo`` per live
session (where its KV is by the sticky router's ``SessionTable``, its KV tokens, whether a turn is in flight
or it is moving), each returned ``Move`` is executed by the cluster, and on completion the table is rewritten
(``table.assign``), as ``MoveSession.run`` does on success. With ``SimConfig.load_signal="sessions"`` the signals'
``running`` counts the sessions whose KV each instance holds (the last instance a session's turn went to, or
that it moved to) instead of the requests in its batch. A session's next turn waits while it moves; its
TTFT counts from when it was issued.

Turn timing: an agent turn is issued ``gap_s`` after the previous one finished; a replayed turn at its
``arrival_s``, or when the previous turn of its session finished if that is later (a conversation does not
send its next message before the reply). Deterministic: the seed draws the closed loop's start times; ties
between events run in the order they were scheduled.

Does not own: the engines (``sim.engine``), the cluster's signals and moves (``sim.cluster``), metrics.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import msgspec
import numpy as np

from tensorcast.errors import InvalidArgument
from tensorcast.policies.rebalancer import Move, Rebalancer, SessionInfo
from tensorcast.policies.routers import Request, Router, load
from tensorcast.policies.sessions import StickySessions
from tensorcast.records import InstanceInfo
from tensorcast.sim.cluster import SimCluster
from tensorcast.sim.engine import EventLoop, SimConfig, SimRequest
from tensorcast.sim.kvcache import Tokens, extend_keys, session_salt
from tensorcast.sim.metrics import MoveRecord, SimResult, TurnRecord
from tensorcast.workloads.agent import AgentWorkload
from tensorcast.workloads.turns import Session

__all__ = ["ClosedLoop", "Policy", "Replay", "simulate"]

MIN_TICK_S = 0.01  # a rebalancer with interval_s=0 is still ticked at most this often (simulated time)


@dataclass
class Policy:
    """``router`` routes every turn; ``shared_kv``: the instances share a KV store (a local miss loads what
    the store holds instead of recomputing it); ``rebalancer``: ticked every ``interval_s``, it needs a
    ``StickySessions`` router, whose table its moves rewrite. Policy objects keep state: one per run."""

    name: str
    router: Router
    shared_kv: bool = False
    rebalancer: Rebalancer | None = None

    def __post_init__(self) -> None:
        if self.rebalancer is not None and not isinstance(self.router, StickySessions):
            raise InvalidArgument(f"policy {self.name!r}: a rebalancer moves sessions in a StickySessions "
                                  "router's table; wrap the router in StickySessions")


@dataclass(frozen=True)
class ClosedLoop:
    """``concurrency`` slots, each running ``workload``'s sessions back to back (sessions 0, 1, ... in the
    order slots ask), the first one of each slot starting at a uniform random time in ``[0, ramp_s)``; no
    turn is issued at or after ``horizon_s`` (turns in flight finish)."""

    workload: AgentWorkload
    concurrency: int
    horizon_s: float
    ramp_s: float = 0.0

    def __post_init__(self) -> None:
        if self.concurrency < 1 or not self.horizon_s > 0 or self.ramp_s < 0:
            raise InvalidArgument(f"bad closed loop: concurrency={self.concurrency}, horizon_s={self.horizon_s}, "
                                  f"ramp_s={self.ramp_s}")


@dataclass(frozen=True)
class Replay:
    """``sessions`` as given: a session starts at its first turn's ``arrival_s`` (0 when None)."""

    sessions: Sequence[Session]
    horizon_s: float = math.inf


@dataclass(eq=False)
class _Live:
    """A session in progress."""

    session: Session
    slot: int                                            # closed-loop slot, -1 for a replayed session
    next_turn: int = 0
    next_keys: list[int] = field(default_factory=list)   # blocks of the next turn's prompt, once known
    prev_prompt: Tokens | None = None                    # the last issued prompt (its keys: next_keys' base)
    prev_keys: list[int] = field(default_factory=list)
    context_tokens: int = 0                              # KV tokens after the last finished turn
    context_keys: list[int] = field(default_factory=list)
    issued_s: float = 0.0
    busy: bool = False                                   # a turn issued and not finished
    where: str | None = None                             # the instance holding its KV (its last turn's, or a move's)
    stay: int = 0                                        # how many times it changed instance (SimConfig.prefix_sharing)
    moving: bool = False
    held_for_move: bool = False                          # its issued turn waits for the move to end


class _Simulation:
    """One run: the cluster, the live sessions, the records; ``run`` schedules the starts and drains the loop."""

    def __init__(self, policy: Policy, arrivals: ClosedLoop | Replay, config: SimConfig, seed: int) -> None:
        self.policy, self.arrivals, self.config = policy, arrivals, config
        self.loop = EventLoop()
        self.cluster = SimCluster(self.loop, config, policy.shared_kv)
        self.rng = np.random.default_rng(seed)
        self.horizon = arrivals.horizon_s
        self.live: dict[str, _Live] = {}
        self.turns: list[TurnRecord] = []
        self.moves: list[MoveRecord] = []
        self.started = 0
        self.next_index = 0
        self.pending_starts = 0
        self.load_gaps: list[int] = []  # max - min load over the instances, seen at each routing decision
        self.table = policy.router.table if isinstance(policy.router, StickySessions) else None

    def run(self) -> SimResult:
        if isinstance(self.arrivals, ClosedLoop):
            n = self.arrivals.concurrency
            starts = np.sort(self.rng.uniform(0.0, self.arrivals.ramp_s, n)) if self.arrivals.ramp_s else np.zeros(n)
            for slot, when in enumerate(starts):
                self._later(float(when), partial(self._start_next, slot))
        else:
            for session in self.arrivals.sessions:
                if session.turns:
                    first = session.turns[0].arrival_s or 0.0
                    self._later(first, partial(self._start, session, -1))
        if self.policy.rebalancer is not None:
            self.loop.at(0.0, self._tick)
        self.loop.run()
        store_hits = sum(t.store_hit_tokens for t in self.turns)
        return SimResult(self.policy.name, tuple(self.turns), tuple(self.moves), self.started, self.loop.now,
                         self.config.cost.kv_bytes(store_hits), self.loop.events,
                         float(np.mean(self.load_gaps)) if self.load_gaps else 0.0)

    def _later(self, when: float, start: Callable[[], None]) -> None:
        """Schedule a session start (counted, so the rebalancer keeps ticking until every session ran)."""
        self.pending_starts += 1

        def fire() -> None:
            self.pending_starts -= 1
            start()

        self.loop.at(when, fire)

    def _start_next(self, slot: int) -> None:
        assert isinstance(self.arrivals, ClosedLoop)
        if self.loop.now < self.horizon:
            self.next_index += 1
            self._start(self.arrivals.workload.session(self.next_index - 1), slot)

    def _start(self, session: Session, slot: int) -> None:
        if self.loop.now >= self.horizon or session.session_id in self.live:
            return
        live = _Live(session, slot)
        self.live[session.session_id] = live
        self.started += 1
        self._issue(live)

    def _issue(self, live: _Live) -> None:
        live.issued_s, live.busy = self.loop.now, True
        if live.moving:
            live.held_for_move = True
        else:
            self._dispatch(live)

    def _dispatch(self, live: _Live) -> None:
        """Route the session's next turn and queue it on the chosen instance."""
        turns, bt = live.session.turns, self.config.block_tokens
        turn = turns[live.next_turn]
        keys = live.next_keys or extend_keys(turn.prompt, bt, live.prev_prompt, live.prev_keys)
        extra: list[int] = []
        live.next_keys = []
        if live.next_turn + 1 < len(turns):
            nxt = turns[live.next_turn + 1]
            live.next_keys = extend_keys(nxt.prompt, bt, turn.prompt, keys)
            reused = (nxt.prompt_tokens - nxt.new_tokens) // bt  # blocks of this turn's prompt + output it reuses
            if not keys or (len(live.next_keys) >= len(keys) and live.next_keys[len(keys) - 1] == keys[-1]):
                extra = live.next_keys[len(keys):reused]
        live.prev_prompt, live.prev_keys = turn.prompt, keys
        instances = self._signals()
        loads = [load(i) for i in instances]
        self.load_gaps.append(max(loads) - min(loads))
        target = self.policy.router.route(Request(live.session.session_id, turn.prompt), instances)
        if target != live.where:  # a new stay (its first, or after a change of instance)
            if live.where is not None:
                live.stay += 1
            live.where = target
        request = SimRequest(turn, keys, extra, live.issued_s, self._done, salt=self._salt(live, live.stay))
        self.cluster.submit(target, request)

    def _salt(self, live: _Live, stay: int) -> int:
        """How an instance's own cache names this session's blocks during its ``stay``-th stay anywhere."""
        return 0 if self.config.prefix_sharing else session_salt(live.session.session_id, stay)

    def _signals(self) -> list[InstanceInfo]:
        """``list_instances()``, with ``running`` counting resident sessions if the config says so."""
        instances = self.cluster.list_instances()
        if self.config.load_signal == "engine":
            return instances
        resident = Counter(live.where for live in self.live.values() if live.where is not None)
        return [msgspec.structs.replace(i, running=resident[i.instance_id]) for i in instances]

    def _done(self, request: SimRequest) -> None:
        turn = request.turn
        live = self.live[turn.session_id]
        self.turns.append(TurnRecord(turn.session_id, turn.turn, request.instance_id, request.issued_s,
                                     request.first_token_s, request.done_s, turn.prompt_tokens,
                                     request.local_hit_tokens, request.store_hit_tokens, turn.output_tokens))
        live.busy = False
        live.context_tokens = turn.prompt_tokens + turn.output_tokens
        live.context_keys = [*request.keys, *request.extra_keys]
        live.next_turn += 1
        finished = live.next_turn == len(live.session.turns)
        if not finished:
            nxt = live.session.turns[live.next_turn]
            when = max(nxt.arrival_s, self.loop.now) if nxt.arrival_s is not None else self.loop.now + nxt.gap_s
            if when < self.horizon:
                self.loop.at(when, lambda: self._issue(live))
                return
        del self.live[turn.session_id]
        if self.table is not None:
            self.table.forget(turn.session_id)
        if finished and live.slot >= 0:  # a session cut short by the horizon is not replaced
            self._start_next(live.slot)

    def _tick(self) -> None:
        rebalancer = self.policy.rebalancer
        if rebalancer is None or (not self.live and not self.pending_starts):
            return
        sessions = []
        for sid, live in self.live.items():
            where = self.table.get(sid) if self.table is not None else None
            if where is not None and live.context_tokens:
                sessions.append(SessionInfo(sid, where, live.context_tokens, live.busy or live.moving))
        for move in rebalancer.decide(self.loop.now, self._signals(), sessions):
            self._move(move)
        self.loop.at(self.loop.now + max(rebalancer.interval_s, MIN_TICK_S), self._tick)

    def _move(self, move: Move) -> None:
        live = self.live.get(move.session_id)
        where = self.table.get(move.session_id) if self.table is not None else None
        if live is None or live.busy or live.moving or where != move.source:
            raise InvalidArgument(f"cannot move {move.session_id!r} from {move.source!r}: it is not an idle "
                                  f"session there (at {where!r})")
        live.moving = True
        self.cluster.move(move, live.context_keys, lambda record: self._moved(live, record),
                          salt=self._salt(live, live.stay + 1))

    def _moved(self, live: _Live, record: MoveRecord) -> None:
        self.moves.append(record)
        live.moving = False
        live.where, live.stay = record.target, live.stay + 1
        if self.table is not None:
            self.table.assign(record.session_id, record.target)
        if live.held_for_move:
            live.held_for_move = False
            self._dispatch(live)


def simulate(policy: Policy, arrivals: ClosedLoop | Replay, config: SimConfig | None = None,
             seed: int = 0) -> SimResult:
    """Run ``arrivals`` through ``policy`` on a simulated cluster until every issued turn finished."""
    return _Simulation(policy, arrivals, config or SimConfig(), seed).run()
