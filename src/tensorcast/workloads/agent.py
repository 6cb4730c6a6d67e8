"""Multi-turn agent sessions, drawn: a coding agent whose context grows every turn by a tool's output.

Owns: ``AgentWorkload`` (the shape's parameters and the draws) and the inter-turn gap presets
(``GAP_PRESETS``). The shape follows public agent traces (SWE-Gym / OpenHands trajectories): about 19 turns
per session on average and at most 50; every session starts with one shared system prompt, then each turn
appends a tool's output of about 2k tokens and the agent's short reply, so prompt tokens outnumber output
tokens about 100 to 1. The exact distributions below are this project's choice, not a fit:

- turns: ``1 + Binomial(max_turns - 1, p)`` with ``p ~ Beta(2, b)``, ``b`` set so the mean is ``mean_turns``
  (a right-skewed count that never exceeds ``max_turns``);
- the task (first turn) and each tool output: LogNormal with mean ``tool_tokens`` and log-sd ``length_sigma``;
- a turn's output: LogNormal with mean ``prompt tokens / io_ratio`` (so the ratio holds over a run), >= 1;
- gaps between a turn's completion and the next turn: LogNormal(mu, sigma) seconds, presets ``fast``
  (0.5, 1.0; median 1.6 s), ``medium`` (1.65, 1.18; median 5.2 s — a fit to a published trace of Codex on
  SWE-bench Pro) and ``slow`` (2.5, 1.2; median 12.2 s).

``scale`` multiplies every token count (the system prompt, task and tool outputs; outputs follow from the
prompt) so CPU engines can run the same shape. Session ``i`` of a seed is always the same, however many
sessions are drawn (its generator is seeded with ``(seed, i)``). Token ids are uniform over the vocabulary:
only their equality matters (prefix reuse), not their meaning.

Does not own: pacing or routing the turns (a driver or simulator does), or replaying recorded traces
(``workloads.trace``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tensorcast.errors import InvalidArgument
from tensorcast.workloads.turns import Session, TokenIds, Turn

__all__ = ["GAP_PRESETS", "AgentWorkload", "GapPreset"]

# Seeds the shared system prompt's generator apart from every session's ((seed, index) pairs).
_SYSTEM_STREAM = 0x5157
# Beta's first shape for turn counts; the second follows from the mean.
_TURNS_BETA_A = 2.0


@dataclass(frozen=True)
class GapPreset:
    """Inter-turn gaps ~ LogNormal(``mu``, ``sigma``) seconds (``mu``, ``sigma``: of the log)."""

    mu: float
    sigma: float

    @property
    def median_s(self) -> float:
        return math.exp(self.mu)


GAP_PRESETS: dict[str, GapPreset] = {
    "fast": GapPreset(0.5, 1.0),
    "medium": GapPreset(1.65, 1.18),
    "slow": GapPreset(2.5, 1.2),
}


@dataclass(frozen=True)
class AgentWorkload:
    """Draws agent sessions; see the module docstring for each parameter's role."""

    gaps: str | GapPreset = "medium"
    mean_turns: float = 19.0
    max_turns: int = 50
    system_tokens: int = 2048
    tool_tokens: int = 2048
    io_ratio: float = 100.0
    length_sigma: float = 0.5
    scale: float = 1.0
    vocab_size: int = 32000
    seed: int = 0
    session_prefix: str = "agent"

    def __post_init__(self) -> None:
        if isinstance(self.gaps, str) and self.gaps not in GAP_PRESETS:
            raise InvalidArgument(f"unknown gap preset {self.gaps!r}; presets: {sorted(GAP_PRESETS)}")
        if not 1 < self.mean_turns < self.max_turns:
            raise InvalidArgument(f"need 1 < mean_turns < max_turns, got {self.mean_turns}, {self.max_turns}")
        if self.scale <= 0 or self.io_ratio <= 0 or self.length_sigma < 0 or self.vocab_size < 2:
            raise InvalidArgument(f"bad workload settings: scale={self.scale}, io_ratio={self.io_ratio}, "
                                  f"length_sigma={self.length_sigma}, vocab_size={self.vocab_size}")
        if self.system_tokens < 0 or self.tool_tokens < 1:
            raise InvalidArgument(f"need system_tokens >= 0 and tool_tokens >= 1, got {self.system_tokens}, "
                                  f"{self.tool_tokens}")

    @property
    def gap(self) -> GapPreset:
        return GAP_PRESETS[self.gaps] if isinstance(self.gaps, str) else self.gaps

    def system_prompt(self) -> TokenIds:
        """The prefix every session starts with."""
        n = max(0, round(self.system_tokens * self.scale))
        rng = np.random.default_rng([self.seed, _SYSTEM_STREAM])
        return rng.integers(0, self.vocab_size, n, dtype=np.int32)

    def turn_count(self, rng: np.random.Generator) -> int:
        b = _TURNS_BETA_A * (self.max_turns - self.mean_turns) / (self.mean_turns - 1)
        return 1 + int(rng.binomial(self.max_turns - 1, rng.beta(_TURNS_BETA_A, b)))

    def _length(self, rng: np.random.Generator, mean: float) -> int:
        """A LogNormal draw with the given mean, at least 1."""
        mu = math.log(mean) - self.length_sigma ** 2 / 2
        return max(1, round(float(rng.lognormal(mu, self.length_sigma))))

    def session(self, index: int) -> Session:
        """Session ``index`` (the same for a given seed, whatever else is drawn)."""
        if index < 0:
            raise InvalidArgument(f"session index must be >= 0, got {index}")
        rng = np.random.default_rng([self.seed, index])
        system = self.system_prompt()
        tool_mean = max(1.0, self.tool_tokens * self.scale)
        shapes: list[tuple[float, int, int, int]] = []  # (gap, prompt length, new tokens, output tokens)
        end = len(system)  # tokens so far: prompt plus previous output
        for t in range(self.turn_count(rng)):
            new = self._length(rng, tool_mean)
            gap = 0.0 if t == 0 else float(rng.lognormal(self.gap.mu, self.gap.sigma))
            prompt_len = end + new
            output = self._length(rng, prompt_len / self.io_ratio)
            shapes.append((gap, prompt_len, new + (len(system) if t == 0 else 0), output))
            end = prompt_len + output
        tokens = np.concatenate([system, rng.integers(0, self.vocab_size, end - len(system), dtype=np.int32)])
        tokens.flags.writeable = False
        sid = f"{self.session_prefix}-{index:05d}"
        return Session(sid, tuple(Turn(sid, t, gap, tokens[:plen], new, out)
                                  for t, (gap, plen, new, out) in enumerate(shapes)))

    def sessions(self, n: int, start: int = 0) -> list[Session]:
        """Sessions ``start`` .. ``start + n - 1``."""
        if n < 0:
            raise InvalidArgument(f"n must be >= 0, got {n}")
        return [self.session(i) for i in range(start, start + n)]
