"""The records every workload produces: a ``Session`` of ``Turn``s, each a prompt to send and how much to
generate.

Owns: the two records and their few derived quantities. Does not own: how a workload draws or reads them
(``workloads.agent``, ``workloads.trace``) or how a driver paces and routes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["Session", "Turn"]

TokenIds = npt.NDArray[np.int32]


@dataclass(frozen=True, eq=False)
class Turn:
    """One request of a session.

    ``gap_s``: seconds between the previous turn and this one's arrival — after the previous turn
    *completed* for agent workloads (a tool ran, the agent thought), after the previous request *arrived*
    for a replayed trace (a trace records no completions); 0.0 for a session's first turn.
    ``arrival_s``: seconds after the trace's first request (replayed traces; None for drawn workloads, where a
    driver decides when sessions start). ``prompt``: the whole prompt's token ids (a read-only view; a turn's
    prompt starts with the previous turn's). ``new_tokens``: the prompt's tokens that the previous turn's
    prompt and output did not already hold (the whole prompt on a first turn). ``output_tokens``: how many
    tokens to generate."""

    session_id: str
    turn: int
    gap_s: float
    prompt: TokenIds
    new_tokens: int
    output_tokens: int
    arrival_s: float | None = None

    @property
    def request_id(self) -> str:
        return f"{self.session_id}/{self.turn}"

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)


@dataclass(frozen=True, eq=False)
class Session:
    session_id: str
    turns: tuple[Turn, ...]

    @property
    def input_tokens(self) -> int:
        """Prompt tokens over all turns (what an engine is asked to prefill without any cache)."""
        return sum(t.prompt_tokens for t in self.turns)

    @property
    def output_tokens(self) -> int:
        return sum(t.output_tokens for t in self.turns)
