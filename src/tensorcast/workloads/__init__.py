"""Workloads for routing and rebalancing experiments: drawn multi-turn agent sessions and replayed traces.

Owns nothing itself; re-exports ``turns`` (the ``Session`` and ``Turn`` records), ``agent`` (drawn agent
sessions, inter-turn gap presets) and ``trace`` (Mooncake-format trace replay). Every draw is seeded; no
path is built in. See ``docs/policies.md``.
"""

from tensorcast.workloads.agent import GAP_PRESETS, AgentWorkload, GapPreset
from tensorcast.workloads.trace import (
    BLOCK_TOKENS,
    TraceRecord,
    block_token_ids,
    group_sessions,
    load_trace,
    parse_records,
    read_trace,
    replay,
)
from tensorcast.workloads.turns import Session, Turn

__all__ = [
    "BLOCK_TOKENS",
    "GAP_PRESETS",
    "AgentWorkload",
    "GapPreset",
    "Session",
    "TraceRecord",
    "Turn",
    "block_token_ids",
    "group_sessions",
    "load_trace",
    "parse_records",
    "read_trace",
    "replay",
]
