"""Live evaluation of the routing and rebalancing policies: agent sessions replayed against 4 engine instances.

Owns: the live half of ``benchmarks/rebalance.py`` (``run_live``, ``add_live_arguments``) and a standalone entry
point (``python benchmarks/rebalance_live.py --quick --json PATH``). It starts a local cluster (4 workers, one
tiny seeded HF Llama instance per worker, all replicas of the same weights), connects one client to the
gateway, and replays ``AgentWorkload`` sessions through each policy at N concurrent sessions:

- ``power-of-two``, ``cache-aware``: the router picks an instance per turn; only the instance's local prefix
  cache helps (the turn continues the session's previous request when it lands where that request is, else
  it recomputes; ``kv_reuse`` off);
- ``load-aware+shared``: least loaded per turn, the shared KV page store on (``kv_reuse``), plus the local
  continue when the turn lands where the session's previous request is;
- ``sticky+shared``: sessions stay where they were first placed (least loaded), shared store and local
  continue — the rebalancer's policy without moves, so its effect is isolated;
- ``tensorcast``: ``sticky+shared`` plus a ``Rebalancer`` ticking in the driver, whose moves run with
  ``MoveSession`` (publish the session's last request's KV, prefetch it to the target's worker, hydrate it
  there, reroute); the session's next turn continues locally on the target.

Instances store a prefill's new KV pages before replying (``--kv-store sync``, the default: inside the TTFT of
every shared-store turn) or after (``--kv-store background``: a write-back cache, as SGLang's HiCache writes
to its storage backend after the request). On this 2-vCPU host the background store competes with the next
prefill for the CPU and the GIL, and did not lower TTFT in the one run that compared them (policies.md).

The driver is the gateway's router: it keeps one FIFO queue per instance and sends an instance one turn at a
time (an engine here serves one request at a time), so queueing is visible to it and counted in TTFT
(submit -> prefill reply). The load signals the policies see are ``list_instances()`` records (liveness, home
workers) with ``running`` = session caches the instance holds and ``waiting`` = turns queued for it, counted
by the driver: the instance heartbeat lags by its interval and cannot see turns queued in front of the engine.
Turn gaps are the preset's, multiplied by ``--time-scale`` (the runs are compressed in time; token counts by
``--live-scale``). Each policy's run relabels token ids with a seeded permutation of the vocabulary, so pages
stored by an earlier run can never be hit by a later one while lengths, gaps and prefix sharing stay
identical across policies.

Does not own: the policies (``tensorcast.policies``), the workload (``tensorcast.workloads``), the simulator
half or the figures of ``benchmarks/rebalance.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import itertools
import math
import platform
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

import tensorcast as tc
from benchlib import pyplot, write_json
from tensorcast.cluster import LocalCluster
from tensorcast.errors import InvalidArgument
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

POLICIES = ("power-of-two", "cache-aware", "load-aware+shared", "sticky+shared", "tensorcast")
SHARED_KV = {"load-aware+shared", "sticky+shared", "tensorcast"}
INSTANCES = 4
VOCAB = 256  # tiny_llama's vocabulary
SESSIONS = (8, 16, 32)
QUICK_SESSIONS = (8, 16)
HDR = (f"{'sess':>5} {'policy':<18} {'turns':>6} {'med TTFT s':>10} {'p90 TTFT s':>10} {'hit':>6} {'local':>6} "
       f"{'store':>6} {'moved':>6} {'MB moved':>9} {'load gap':>8} {'wall s':>7}")


# ----------------------------------------------------------------- arguments
def add_live_arguments(ap: argparse.ArgumentParser) -> None:
    """The options only the live run has (``rebalance.py`` adds --quick, --json, --plot, --seed, --interval,
    --gap, --max-moves, --cooldown, the simulator's too; the standalone entry point adds them as well)."""
    ap.add_argument("--sessions", default=None, help="concurrent sessions, comma separated (default 8,16,32; "
                                                      "quick 8,16)")
    ap.add_argument("--gaps", default="fast", choices=("fast", "medium", "slow"), help="inter-turn gap preset")
    ap.add_argument("--time-scale", type=float, default=0.25,
                    help="multiply every gap and rebalancer period by this (runs compressed in time)")
    ap.add_argument("--live-scale", type=float, default=None,
                    help="workload token scale (default 0.1: ~200-token tool outputs; contexts reach 1-2k)")
    ap.add_argument("--live-turns", type=float, default=None,
                    help="mean turns per session (default 8; quick 6), at most 3x that")
    ap.add_argument("--rounds", type=int, default=None,
                    help="sessions each concurrency slot runs back to back (default 2)")
    ap.add_argument("--layers", type=int, default=4, help="tiny Llama layers per instance")
    ap.add_argument("--kv-store", choices=("sync", "background"), default="sync",
                    help="shared-store policies: an instance stores a prefill's new KV pages before replying "
                         "(sync) or after (background, as a write-back engine cache does)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="runs of every (sessions, policy), turns pooled (default 3; quick 2)")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma separated subset of " + ",".join(POLICIES))


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    quick = bool(getattr(args, "quick", False))
    counts = SESSIONS if not args.sessions else tuple(int(x) for x in args.sessions.split(","))
    if quick and not args.sessions:
        counts = QUICK_SESSIONS
    mean_turns = args.live_turns if args.live_turns is not None else (6.0 if quick else 8.0)
    policies = tuple(p for p in args.policies.split(",") if p)
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown or not policies:
        raise InvalidArgument(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    if args.time_scale <= 0 or any(n < 1 for n in counts) or (args.repeats is not None and args.repeats < 1):
        raise InvalidArgument("need --time-scale > 0, session counts >= 1 and --repeats >= 1")
    return {
        "quick": quick,
        "sessions": counts,
        "policies": policies,
        "gaps": args.gaps,
        "time_scale": args.time_scale,
        "scale": args.live_scale if args.live_scale is not None else 0.1,
        "mean_turns": mean_turns,
        "max_turns": max(int(mean_turns) + 2, int(3 * mean_turns)),
        "rounds": args.rounds if args.rounds is not None else 2,
        "repeats": args.repeats if args.repeats is not None else (2 if quick else 3),
        "layers": args.layers,
        "kv_store": args.kv_store,
        "seed": getattr(args, "seed", 0),
        "interval_s": getattr(args, "interval", 0.5),
        "gap": getattr(args, "gap", 1),
        "max_moves": getattr(args, "max_moves", 2),
        "cooldown_s": getattr(args, "cooldown", 60.0),
    }


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
    """The session with token ids mapped through ``perm`` (same lengths, gaps and shared prefixes)."""
    tokens = perm[session.turns[-1].prompt]
    return Session(session.session_id, tuple(
        Turn(t.session_id, t.turn, t.gap_s, tokens[: t.prompt_tokens], t.new_tokens, t.output_tokens)
        for t in session.turns))


def make_router(name: str, seed: int) -> Router:
    if name == "power-of-two":
        return PowerOfTwo(seed)
    if name == "cache-aware":
        return CacheAware()
    if name == "load-aware+shared":
        return LoadAwareShared()
    return StickySessions(LoadAwareShared())


# ----------------------------------------------------------------- one run
def run_policy(client: tc.Client, ids: list[str], name: str, n_sessions: int, s: dict[str, Any],
               run_index: int) -> tuple[RunRecord, float]:
    """Replay ``rounds`` x ``n_sessions`` sessions (``n_sessions`` at a time) through policy ``name``."""
    ts = s["time_scale"]
    work = AgentWorkload(gaps=s["gaps"], mean_turns=s["mean_turns"], max_turns=s["max_turns"], scale=s["scale"],
                         vocab_size=VOCAB, seed=s["seed"])
    perm = np.random.default_rng([s["seed"], 7919, run_index]).permutation(VOCAB).astype(np.int32)
    rng = np.random.default_rng([s["seed"], n_sessions])  # start offsets: the same for every policy
    router = make_router(name, s["seed"])
    rebalancer = (Rebalancer(interval_s=s["interval_s"] * ts, gap=s["gap"], max_moves_per_tick=s["max_moves"],
                             cooldown_s=s["cooldown_s"] * ts) if name == "tensorcast" else None)
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
    pending_sessions = {slot: [work.session(r * n_sessions + slot) for r in range(s["rounds"])]
                        for slot in range(n_sessions)}
    stagger = math.exp(work.gap.mu) * ts  # first sessions start spread over one median gap
    for slot in range(n_sessions):
        heapq.heappush(events, (t_start + float(rng.uniform(0, stagger)), next(seq), "start", slot))
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
        if pending_sessions[slot]:
            gap = float(rng.lognormal(work.gap.mu, work.gap.sigma)) * ts
            heapq.heappush(events, (time.monotonic() + gap, next(seq), "start", slot))

    remaining = n_sessions * s["rounds"]
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
                gap = state.session.turns[state.next_turn].gap_s * ts
                heapq.heappush(events, (time.monotonic() + gap, next(seq), "turn", state))
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


def summarize(name: str, n: int, s: dict[str, Any], runs: list[tuple[RunRecord, float]]) -> dict[str, Any]:
    """One row over every repeat of (policy, sessions): turns pooled, each repeat's median kept to show the
    run-to-run spread."""
    rec = RunRecord()
    for r, _ in runs:
        rec.turns += r.turns
        rec.moves += r.moves
        rec.load_gaps += r.load_gaps
        rec.errors += r.errors
    wall = sum(w for _, w in runs)
    ttft = np.array([t["ttft_s"] for t in rec.turns])
    prompt = sum(t["prompt_tokens"] for t in rec.turns)
    local = sum(t["local_tokens"] for t in rec.turns)
    shared = sum(t["shared_tokens"] for t in rec.turns)
    ok_moves = [m for m in rec.moves if m["ok"]]

    def ratio(a: float, b: float) -> float:
        return a / b if b else math.nan

    return {
        "policy": name, "preset": s["gaps"], "sessions": n, "turns": len(rec.turns),
        "median_ttft_s": float(np.median(ttft)) if len(ttft) else math.nan,
        "p90_ttft_s": float(np.percentile(ttft, 90)) if len(ttft) else math.nan,
        "mean_ttft_s": float(ttft.mean()) if len(ttft) else math.nan,
        "mean_queue_s": float(np.mean([t["queue_s"] for t in rec.turns])) if rec.turns else math.nan,
        "hit_rate": ratio(local + shared, prompt), "local_hit_rate": ratio(local, prompt),
        "store_hit_rate": ratio(shared, prompt),
        "sessions_moved": len({m["session"] for m in ok_moves}), "moves": len(ok_moves),
        "failed_moves": len(rec.moves) - len(ok_moves), "bytes_moved": sum(m["bytes"] for m in ok_moves),
        "mean_load_gap": float(np.mean(rec.load_gaps)) if rec.load_gaps else math.nan,
        "wall_s": wall, "errors": rec.errors[:10], "error_count": len(rec.errors), "repeats": len(runs),
        "median_ttft_by_repeat_s": [float(np.median([t["ttft_s"] for t in r.turns])) if r.turns else math.nan
                                    for r, _ in runs],
        "_samples": rec.turns, "_moves": rec.moves,
    }


def show(row: dict[str, Any]) -> None:
    print(f"{row['sessions']:>5} {row['policy']:<18} {row['turns']:>6} {row['median_ttft_s']:>10.3f} "
          f"{row['p90_ttft_s']:>10.3f} {row['hit_rate']:>6.3f} {row['local_hit_rate']:>6.3f} "
          f"{row['store_hit_rate']:>6.3f} {row['sessions_moved']:>6} {row['bytes_moved'] / 1e6:>9.2f} "
          f"{row['mean_load_gap']:>8.2f} {row['wall_s']:>7.1f}", flush=True)


# ----------------------------------------------------------------- cluster and entry points
def measure_prefill(layers: int) -> dict[str, float]:
    """Prefill seconds of the instance's model in this process (one thread, as the instances run), so the
    report says what a turn costs on this CPU."""
    import torch

    from tensorcast.instance.hf import HFCausalLMAdaptor, tiny_llama

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = HFCausalLMAdaptor(tiny_llama(0, layers=layers))
        ids = [int(t) for t in np.random.default_rng(0).integers(0, VOCAB, 2048)]
        out = {}
        for n in (256, 1024, 2048):
            a.prefill("warm", ids[:n])
            best = math.inf
            for _ in range(3):
                t0 = time.perf_counter()
                a.prefill("x", ids[:n])
                best = min(best, time.perf_counter() - t0)
            out[f"prefill_{n}_s"] = best
        t0 = time.perf_counter()
        a.generate("x", 16)
        out["decode_token_s"] = (time.perf_counter() - t0) / 16
        return out
    finally:
        torch.set_num_threads(threads)


def warm_up(client: tc.Client, ids: list[str]) -> None:
    """One prefill with the shared store, one decode and one move per instance before anything is measured:
    first calls pay for imports, connections and allocations that no policy should be charged for. The
    prompts are drawn from a stream no run uses, and every request is dropped afterwards."""
    from tensorcast.policies import SessionTable

    rng = np.random.default_rng(0xC0FFEE)
    mover = MoveSession(client, SessionTable(), timeout=60)
    listed = client.list_instances()
    for k, inst in enumerate(ids):
        rid = f"warm-up/{inst}"
        prompt = [int(t) for t in rng.integers(0, VOCAB, 300)]
        for reuse in (True, False):
            client.call_instance(inst, "engine", args={"command": "prefill", "request_id": rid,
                                                       "input_ids": prompt, "kv_reuse": reuse})
        client.call_instance(inst, "engine", args={"command": "generate", "request_id": rid, "max_new_tokens": 4})
        target = ids[(k + 1) % len(ids)]
        mover.run(Move(rid, inst, target, len(prompt), rid, -1.0 - k), listed)
        for where in (inst, target):
            client.call_instance(where, "engine", args={"command": "drop", "request_id": rid})


def run_live(args: argparse.Namespace) -> dict[str, Any]:
    """Run every policy at every session count on a fresh 4-instance cluster; returns ``rows`` (one per
    policy and count), ``calibration_samples`` (per turn and per move) and the settings."""
    s = _settings(args)
    costs = measure_prefill(s["layers"])
    print(f"live: {INSTANCES} HF tiny-llama instances ({s['layers']} layers, hidden 64, vocab {VOCAB}, float32, "
          f"1 thread each) on {platform.machine()} with {_cpus()} CPUs; prefill 256/1024/2048 tokens = "
          f"{costs['prefill_256_s'] * 1e3:.1f}/{costs['prefill_1024_s'] * 1e3:.1f}/"
          f"{costs['prefill_2048_s'] * 1e3:.1f} ms, decode {costs['decode_token_s'] * 1e3:.1f} ms/token")
    print(f"workload: AgentWorkload(gaps={s['gaps']!r}, mean_turns={s['mean_turns']}, max_turns={s['max_turns']}, "
          f"scale={s['scale']}), gaps x {s['time_scale']} (compressed), {s['rounds']} session(s) per slot; "
          f"rebalancer interval {s['interval_s']} x {s['time_scale']} s, gap {s['gap']}, "
          f"max moves {s['max_moves']}, cooldown {s['cooldown_s']} x {s['time_scale']} s")
    rows: list[dict[str, Any]] = []
    samples: list[dict[str, Any]] = []
    move_samples: list[dict[str, Any]] = []
    t0 = time.monotonic()
    with LocalCluster(workers=INSTANCES) as cluster:
        ids = [f"inst-{i}" for i in range(INSTANCES)]
        for i, inst_id in enumerate(ids):
            cluster.start_instance(inst_id, f"w{i}", ["--seed", "0", "--layers", str(s["layers"])] +
                                   (["--kv-store-in-background"] if s["kv_store"] == "background" else []))
        with tc.connect(cluster.address) as client:
            warm_up(client, ids)
            print(f"cluster up and warm in {time.monotonic() - t0:.1f} s\n{HDR}", flush=True)
            runs: dict[tuple[int, str], list[tuple[RunRecord, float]]] = {}
            run_index = 0
            # Repeats go round every (sessions, policy) pair in turn, so slow spells of a shared host spread
            # over all policies rather than landing on one.
            for repeat in range(s["repeats"]):
                for n in s["sessions"]:
                    for name in s["policies"]:
                        rec, wall = run_policy(client, ids, name, n, s, run_index)
                        run_index += 1
                        runs.setdefault((n, name), []).append((rec, wall))
                        samples += [{"policy": name, "sessions": n, "repeat": repeat, **t} for t in rec.turns]
                        move_samples += [{"policy": name, "sessions": n, "repeat": repeat, **m} for m in rec.moves]
                        if s["repeats"] > 1:
                            print(f"  repeat {repeat}: {n} sessions, {name}: {len(rec.turns)} turns, "
                                  f"{wall:.1f} s", flush=True)
            for n in s["sessions"]:
                for name in s["policies"]:
                    row = summarize(name, n, s, runs[(n, name)])
                    row.pop("_samples")
                    row.pop("_moves")
                    rows.append(row)
                    show(row)
    verdict = compare(rows, s["sessions"])
    return {"mode": "live", "settings": s, "model_costs": costs, "rows": rows, "verdict": verdict,
            "calibration_samples": {"turns": samples, "moves": move_samples},
            "total_wall_s": time.monotonic() - t0}


def compare(rows: list[dict[str, Any]], counts: tuple[int, ...]) -> list[str]:
    """Plain statements of who won, printed whatever the answer."""
    lines = []
    for n in counts:
        at = [r for r in rows if r["sessions"] == n and not math.isnan(r["median_ttft_s"])]
        if not at:
            continue
        best = min(at, key=lambda r: r["median_ttft_s"])
        ours = next((r for r in at if r["policy"] == "tensorcast"), None)
        base = next((r for r in at if r["policy"] == "load-aware+shared"), None)
        line = f"{n} sessions: lowest median TTFT {best['policy']} ({best['median_ttft_s'] * 1e3:.1f} ms)"
        if ours is not None and base is not None:
            cut = 100 * (1 - ours["median_ttft_s"] / base["median_ttft_s"])
            line += (f"; tensorcast vs load-aware+shared: median TTFT {ours['median_ttft_s'] * 1e3:.1f} vs "
                     f"{base['median_ttft_s'] * 1e3:.1f} ms (cut {cut:+.1f}%; negative = slower), hit rate "
                     f"{ours['hit_rate']:.3f} vs {base['hit_rate']:.3f}")
        if ours is not None and ours is not best:
            line += " — the rebalancer does NOT have the lowest median TTFT here"
        lines.append(line)
    print()
    for line in lines:
        print(line)
    return lines


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """One PNG: median and p90 TTFT and hit rate vs concurrent sessions, per policy."""
    plt = pyplot()
    if plt is None:
        print("plot: skipped (matplotlib is not installed)")
        return

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels: list[tuple[str, str, Callable[[float], float]]] = [
        ("median_ttft_s", "median TTFT (ms)", lambda v: v * 1e3), ("p90_ttft_s", "p90 TTFT (ms)", lambda v: v * 1e3),
        ("hit_rate", "cache hit rate (local + store)", lambda v: v)]
    for ax, (key, label, f) in zip(axes, panels, strict=True):
        for name in POLICIES:
            pts = sorted((r["sessions"], f(r[key])) for r in rows if r["policy"] == name)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_xlabel("concurrent sessions")
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.suptitle("LIVE: 4 HF tiny-llama instances, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 and 16 sessions, shorter sessions (a few minutes)")
    ap.add_argument("--json", default=None, help="write the results as JSON here")
    ap.add_argument("--plot", default=None, help="write a PNG here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--interval", type=float, default=0.5, help="rebalancer tick, workload seconds")
    ap.add_argument("--gap", type=int, default=1, help="rebalancer gap in resident sessions that triggers a move")
    ap.add_argument("--max-moves", type=int, default=2, help="rebalancer moves per tick at most")
    ap.add_argument("--cooldown", type=float, default=60.0, help="workload seconds a moved session stays put")
    add_live_arguments(ap)
    args = ap.parse_args()
    results = run_live(args)
    if args.plot:
        plot(results["rows"], args.plot)
    write_json(args.json, "rebalance", args.quick, **results)  # results["mode"] is "live"


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
