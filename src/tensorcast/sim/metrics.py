"""What a simulated run measured: one record per turn and per move, and the run's summary.

Owns: ``TurnRecord`` (when a turn was issued, got its first token and finished, where it ran, how many of
its prompt tokens came from the instance's own cache and how many from the shared store), ``MoveRecord``
and ``SimResult`` with ``summary()``: median and p90 TTFT, hit rates (tokens served from a cache / prompt
tokens; local and via the store separately), sessions moved, bytes moved and fetched, throughput.

Does not own: producing the records (``sim.run``) or printing them (the benchmark).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["MoveRecord", "SimResult", "TurnRecord"]


@dataclass(frozen=True)
class TurnRecord:
    session_id: str
    turn: int
    instance_id: str
    issued_s: float        # the turn was issued (the user sent it)
    first_token_s: float   # its first token came out (after queueing, any wait for a move, loads, prefill)
    done_s: float
    prompt_tokens: int
    local_hit_tokens: int  # prompt tokens whose KV was in the instance's own cache
    store_hit_tokens: int  # prompt tokens whose KV was loaded from the shared store
    output_tokens: int

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.issued_s


@dataclass(frozen=True)
class MoveRecord:
    """A session's KV moved from ``source`` to ``target`` (publish, prefetch, hydrate) over
    ``[start_s, done_s]``; ``kv_bytes`` of KV, copied three times on the way."""

    session_id: str
    source: str
    target: str
    kv_tokens: int
    kv_bytes: int
    start_s: float
    done_s: float


@dataclass(frozen=True)
class SimResult:
    """A run's records. ``end_s``: when the last event happened; ``sessions``: sessions started;
    ``fetched_bytes``: KV loaded from the shared store by prefills; ``events``: events simulated;
    ``mean_load_gap``: load (running + waiting) of the most minus the least loaded instance, averaged over the
    routing decisions (how imbalanced the instances were when turns arrived)."""

    policy: str
    turns: tuple[TurnRecord, ...]
    moves: tuple[MoveRecord, ...]
    sessions: int
    end_s: float
    fetched_bytes: int
    events: int
    mean_load_gap: float = 0.0

    def measured(self, since_s: float = 0.0) -> list[TurnRecord]:
        """The turns issued at or after ``since_s`` (a warm-up before it is left out)."""
        return [t for t in self.turns if t.issued_s >= since_s]

    def summary(self, since_s: float = 0.0) -> dict[str, float]:
        """The run in numbers over the turns issued from ``since_s`` on (NaN where there is nothing to
        measure). Moves, fetched bytes and the load gap are over the whole run."""
        turns = self.measured(since_s)
        ttft = np.array([t.ttft_s for t in turns], dtype=np.float64)
        prompt = sum(t.prompt_tokens for t in turns)
        local = sum(t.local_hit_tokens for t in turns)
        store = sum(t.store_hit_tokens for t in turns)
        output = sum(t.output_tokens for t in turns)
        first = min((t.issued_s for t in turns), default=0.0)
        span = max((t.done_s for t in turns), default=0.0) - first

        def ratio(a: float, b: float) -> float:
            return a / b if b else math.nan

        return {
            "sessions": float(self.sessions),
            "turns": float(len(turns)),
            "median_ttft_s": float(np.median(ttft)) if len(ttft) else math.nan,
            "p90_ttft_s": float(np.percentile(ttft, 90)) if len(ttft) else math.nan,
            "mean_ttft_s": float(ttft.mean()) if len(ttft) else math.nan,
            "hit_rate": ratio(local + store, prompt),
            "local_hit_rate": ratio(local, prompt),
            "store_hit_rate": ratio(store, prompt),
            "sessions_moved": float(len({m.session_id for m in self.moves})),
            "moves": float(len(self.moves)),
            "bytes_moved": float(sum(m.kv_bytes for m in self.moves)),
            "bytes_fetched": float(self.fetched_bytes),
            "output_tokens_per_s": ratio(output, span),
            "turns_per_s": ratio(len(turns), span),
            "sim_end_s": self.end_s,
            "events": float(self.events),
            "mean_load_gap": self.mean_load_gap,
        }
