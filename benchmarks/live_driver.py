"""The live run's driver: one policy replaying sessions against the engine instances of a running cluster.

Owns: ``run_policy`` (one run: sessions started closed-loop, ``n_sessions`` at a time, or at a replayed
trace's arrival times; routing each turn, queueing it for its instance, a rebalancer's moves on a thread of
their own, and a record of every turn and move), the driver's view of sessions and instances
(``SessionState``, ``Instances``: one FIFO and one serving thread per instance, so that an engine serves one
turn at a time and the driver sees its queue), ``relabel`` and ``make_router``. Used by
``benchmarks/rebalance_live.py``, which owns the cluster, the settings, the summaries and the figures.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

import tensorcast as tc
from tensorcast.policies import (
    CacheAware,
    LoadAwareShared,
    Move,
    MoveSession,
    PowerOfTwo,
    Rebalancer,
    Request,
    Router,
    SessionInfo,
    StickySessions,
    load,
)
from tensorcast.records import InstanceInfo
from tensorcast.workloads import AgentWorkload, Session, Turn

VOCAB = 256  # tiny_llama's vocabulary
SHARED_KV = {"load-aware+shared", "sticky+shared", "tensorcast"}

# ----------------------------------------------------------------- driver state
@dataclass
class SessionState:
    """One replayed session as the driver (the gateway) knows it."""

    session: Session  # token ids already relabeled for this run
    next_turn: int = 0
    where: str | None = None  # the instance holding its last request's KV cache
    last_request: str = ""
    kv_tokens: int = 0
    busy: bool = False  # a turn queued or in flight
    moving: bool = False
    deferred: tuple[Turn, float] | None = None  # a turn that arrived while a move was running


@dataclass
class TurnJob:
    state: SessionState
    turn: Turn
    instance: str
    continue_from: str | None
    kv_reuse: bool
    arrival: float  # driver clock: when the turn was issued
    started: float = 0.0


@dataclass
class RunRecord:
    turns: list[dict[str, Any]] = field(default_factory=list)
    moves: list[dict[str, Any]] = field(default_factory=list)
    load_gaps: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class Instances:
    """The gateway's view of the instances: one FIFO of turns and one serving thread each (so an instance
    serves one turn at a time and the driver sees the queue), the sessions' caches each holds, and the
    load signals built from both."""

    def __init__(self, client: tc.Client, ids: list[str], done: queue.Queue[tuple[str, Any]]) -> None:
        self.client, self.ids, self.done = client, ids, done
        self.queues: dict[str, queue.Queue[TurnJob | None]] = {i: queue.Queue() for i in ids}
        self.queued = dict.fromkeys(ids, 0)  # turns waiting, not yet sent (driver thread only)
        self.threads = [threading.Thread(target=self._serve, args=(i,), daemon=True) for i in ids]
        for t in self.threads:
            t.start()

    def engine(self, inst: str, command: str, **args: Any) -> dict[str, Any]:
        result: dict[str, Any] = self.client.call_instance(inst, "engine", args={"command": command, **args},
                                                           timeout=120).result
        return result

    def submit(self, job: TurnJob) -> None:
        self.queued[job.instance] += 1
        self.queues[job.instance].put(job)

    def _serve(self, inst: str) -> None:
        q = self.queues[inst]
        while (job := q.get()) is not None:
            job.started = time.monotonic()
            self.done.put(("started", job))
            try:
                prompt = [int(t) for t in job.turn.prompt]
                t0 = time.monotonic()
                reply = self.engine(inst, "prefill", request_id=job.turn.request_id, input_ids=prompt,
                                    kv_reuse=job.kv_reuse, continue_from=job.continue_from)
                t1 = time.monotonic()
                self.engine(inst, "generate", request_id=job.turn.request_id,
                            max_new_tokens=job.turn.output_tokens)
                t2 = time.monotonic()
                self.done.put(("turn", (job, reply["kv"], t0, t1, t2)))
            except Exception as exc:  # a failed turn is reported and counted, not fatal to the run
                self.done.put(("turn_failed", (job, f"{type(exc).__name__}: {exc}")))

    def signals(self, listed: list[InstanceInfo], sessions: list[SessionState]) -> list[InstanceInfo]:
        resident = dict.fromkeys(self.ids, 0)
        for s in sessions:
            if s.where is not None:
                resident[s.where] += 1
        return [msgspec.structs.replace(i, running=resident.get(i.instance_id, 0),
                                    waiting=self.queued.get(i.instance_id, 0)) for i in listed]

    def close(self) -> None:
        for q in self.queues.values():
            q.put(None)
        for t in self.threads:
            t.join(timeout=30)


def relabel(session: Session, perm: np.ndarray) -> Session:
    """The session with token ids mapped through ``perm`` (same lengths, gaps, arrival times and shared
    prefixes)."""
    return Session(session.session_id, tuple(
        Turn(t.session_id, t.turn, t.gap_s, perm[t.prompt], t.new_tokens, t.output_tokens, arrival_s=t.arrival_s)
        for t in session.turns))


def make_router(name: str, seed: int, spill: int | None = 0) -> Router:
    if name == "power-of-two":
        return PowerOfTwo(seed)
    if name == "cache-aware":
        return CacheAware()
    if name == "load-aware+shared":
        return LoadAwareShared()
    # tensorcast (shared store) may send a turn off a busy instance; sticky+shared and tensorcast-local never do.
    return StickySessions(LoadAwareShared(), spill=spill if name == "tensorcast" else None)


# ----------------------------------------------------------------- one run
def run_policy(client: tc.Client, ids: list[str], name: str, n_sessions: int, s: dict[str, Any],
               run_index: int, trace: list[Session] | None = None) -> tuple[RunRecord, float]:
    """Replay ``rounds`` x ``n_sessions`` sessions (``n_sessions`` at a time) through policy ``name``; with
    ``trace``, its sessions instead, each turn issued at its ``arrival_s`` x ``time_scale`` (or when the
    session's previous turn finished, if that is later: a conversation does not overlap itself)."""
    ts = s["time_scale"]
    work = AgentWorkload(gaps=s["gaps"], mean_turns=s["mean_turns"], max_turns=s["max_turns"], scale=s["scale"],
                         vocab_size=VOCAB, seed=s["seed"])
    perm = np.random.default_rng([s["seed"], 7919, run_index]).permutation(VOCAB).astype(np.int32)
    rng = np.random.default_rng([s["seed"], n_sessions])  # start offsets: the same for every policy
    router = make_router(name, s["seed"], s.get("spill", 0))
    rebalancer = (Rebalancer(interval_s=s["interval_s"] * ts, gap=s["gap"], max_moves_per_tick=s["max_moves"],
                             cooldown_s=s["cooldown_s"] * ts) if name.startswith("tensorcast") else None)
    sticky = router if isinstance(router, StickySessions) else None
    mover = MoveSession(client, sticky.table, timeout=60) if sticky is not None else None
    shared = name in SHARED_KV
    done: queue.Queue[tuple[str, Any]] = queue.Queue()
    inst = Instances(client, ids, done)
    rec = RunRecord()
    events: list[tuple[float, int, str, Any]] = []  # (due, seq, kind, payload)
    seq = itertools.count()
    active: dict[str, SessionState] = {}
    janitor: queue.Queue[tuple[str, str] | None] = queue.Queue()  # (instance, request) to drop
    moves_q: queue.Queue[tuple[Move, list[InstanceInfo], SessionState] | None] = queue.Queue()

    def drop_loop() -> None:
        while (item := janitor.get()) is not None:
            with contextlib.suppress(Exception):  # a request already gone is fine
                inst.engine(item[0], "drop", request_id=item[1])

    def move_loop() -> None:
        assert mover is not None
        while (item := moves_q.get()) is not None:
            move, instances, state = item
            t0 = time.monotonic()
            try:
                outcome = mover.run(move, instances)
                nbytes = 0
                for step in outcome.steps:
                    if step.op == "publish":
                        nbytes += sum(client.artifact(a).info.nbytes for a in step.output)
                done.put(("moved", (move, state, outcome.ok, nbytes, time.monotonic() - t0,
                                    "" if outcome.ok else str(outcome.steps))))
            except Exception as exc:
                done.put(("moved", (move, state, False, 0, time.monotonic() - t0, f"{type(exc).__name__}: {exc}")))

    helpers = [threading.Thread(target=drop_loop, daemon=True)]
    if mover is not None:
        helpers.append(threading.Thread(target=move_loop, daemon=True))
    for h in helpers:
        h.start()

    t_start = time.monotonic()
    if trace is None:
        pending_sessions = {slot: [work.session(r * n_sessions + slot) for r in range(s["rounds"])]
                            for slot in range(n_sessions)}
        stagger = math.exp(work.gap.mu) * ts  # first sessions start spread over one median gap
        for slot in range(n_sessions):
            heapq.heappush(events, (t_start + float(rng.uniform(0, stagger)), next(seq), "start", slot))
    else:  # one slot per session, started at its first turn's arrival
        pending_sessions = {k: [session] for k, session in enumerate(trace)}
        for k, session in enumerate(trace):
            heapq.heappush(events, (t_start + (session.turns[0].arrival_s or 0.0) * ts, next(seq), "start", k))
    slot_of: dict[str, int] = {}
    listed = client.list_instances()
    listed_at = time.monotonic()

    def signals() -> list[InstanceInfo]:
        return inst.signals(listed, list(active.values()))

    def dispatch(state: SessionState, turn: Turn, arrival: float) -> None:
        chosen = router.route(Request(state.session.session_id, turn.prompt), signals())
        previous, where = state.last_request, state.where
        cont = previous if previous and where == chosen else None
        if previous and where is not None and where != chosen:
            janitor.put((where, previous))  # its cache is of no further use there: keep memory bounded
        state.where, state.busy = chosen, True
        inst.submit(TurnJob(state, turn, chosen, cont, shared, arrival))

    def arrive(state: SessionState, arrival: float) -> None:
        turn = state.session.turns[state.next_turn]
        if state.moving:
            state.deferred = (turn, arrival)  # dispatched when the move finishes; the wait counts in TTFT
            state.busy = True
            return
        dispatch(state, turn, arrival)

    def finish_session(state: SessionState) -> None:
        sid = state.session.session_id
        if state.where is not None and state.last_request:
            janitor.put((state.where, state.last_request))
        active.pop(sid, None)
        if sticky is not None:
            sticky.table.forget(sid)
        slot = slot_of.pop(sid)
        if pending_sessions[slot] and trace is None:
            gap = float(rng.lognormal(work.gap.mu, work.gap.sigma)) * ts
            heapq.heappush(events, (time.monotonic() + gap, next(seq), "start", slot))

    remaining = n_sessions * s["rounds"] if trace is None else len(trace)
    next_gap_sample = t_start
    while remaining > 0:
        now = time.monotonic()
        if now - listed_at > 1.0:  # liveness and home workers: refreshed, the load is the driver's own
            listed, listed_at = client.list_instances(), now
        while events and events[0][0] <= now:
            due, _, kind, payload = heapq.heappop(events)
            if kind == "start":
                state = SessionState(relabel(pending_sessions[payload].pop(0), perm))
                active[state.session.session_id] = state
                slot_of[state.session.session_id] = payload
                arrive(state, due)
            else:
                arrive(payload, due)
        if now >= next_gap_sample:
            loads = [load(i) for i in signals()]
            rec.load_gaps.append(max(loads) - min(loads))
            next_gap_sample = now + 0.1
        if rebalancer is not None and mover is not None:
            infos = [SessionInfo(st.session.session_id, st.where, st.kv_tokens, st.busy or st.moving,
                                 st.last_request) for st in active.values()
                     if st.where is not None and st.last_request]
            for move in rebalancer.decide(now, signals(), infos):
                state = active[move.session_id]
                state.moving = True
                moves_q.put((move, list(listed), state))
        timeout = 0.02 if not events else min(0.02, max(0.0, events[0][0] - time.monotonic()))
        try:
            kind, payload = done.get(timeout=timeout)
        except queue.Empty:
            continue
        if kind == "started":
            inst.queued[payload.instance] -= 1
        elif kind == "turn":
            job, kv, t0, t1, t2 = payload
            state = job.state
            state.last_request, state.kv_tokens = job.turn.request_id, job.turn.prompt_tokens + job.turn.output_tokens
            state.busy = False
            rec.turns.append({
                "session": state.session.session_id, "turn": job.turn.turn, "instance": job.instance,
                "prompt_tokens": job.turn.prompt_tokens, "local_tokens": int(kv.get("local_tokens", 0)),
                "shared_tokens": int(kv.get("reused_tokens", 0)), "computed_tokens": int(kv["prefilled_tokens"]),
                "ttft_s": t1 - job.arrival, "queue_s": job.started - job.arrival, "prefill_call_s": t1 - t0,
                "prefill_s": float(kv.get("prefill_s", 0.0)),
                "shared_read_s": float(kv.get("lookup_s", 0.0)) + float(kv.get("read_s", 0.0)),
                "store_s": float(kv.get("store_s", 0.0)), "decode_tokens": job.turn.output_tokens,
                "decode_context": job.turn.prompt_tokens, "decode_batch": 1, "decode_call_s": t2 - t1,
                "continued": bool(kv.get("continued_from")), "issued_s": job.arrival - t_start,
            })
            state.next_turn += 1
            if state.next_turn >= len(state.session.turns):
                remaining -= 1
                finish_session(state)
            else:
                nxt = state.session.turns[state.next_turn]
                due = time.monotonic() + nxt.gap_s * ts if nxt.arrival_s is None else \
                    max(time.monotonic(), t_start + nxt.arrival_s * ts)
                heapq.heappush(events, (due, next(seq), "turn", state))
        elif kind == "turn_failed":
            job, err = payload
            rec.errors.append(err)
            job.state.busy = False
            job.state.where, job.state.last_request = None, ""
            remaining -= 1
            finish_session(job.state)
        elif kind == "moved":
            move, state, ok, nbytes, secs, err = payload
            state.moving = False
            rec.moves.append({"session": move.session_id, "source": move.source, "target": move.target,
                              "kv_tokens": move.kv_tokens, "ok": ok, "bytes": nbytes, "seconds": secs,
                              **({"error": err} if err else {})})
            if ok:
                if state.session.session_id in active:
                    state.where = move.target
                janitor.put((move.source, move.request_id))  # the source's copy: superseded
            else:
                rec.errors.append(f"move {move.session_id}: {err}")
                janitor.put((move.target, move.request_id))  # a half-finished move may have hydrated it
            if state.deferred is not None:
                turn, arrival = state.deferred
                state.deferred = None
                dispatch(state, turn, arrival)
    wall = time.monotonic() - t_start
    moves_q.put(None)
    janitor.put(None)
    for h in helpers:
        h.join(timeout=60)
    inst.close()
    return rec, wall
