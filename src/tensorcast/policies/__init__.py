"""Caller policies over the public API: routers, sticky sessions, the rebalancer, and executing its moves.

Owns nothing itself; re-exports the policy modules. Decisions (``routers``, ``prefix_index``, ``sessions``,
``rebalancer``) are pure: recorded signals in (``InstanceInfo`` from ``Client.list_instances()``, requests,
session records, a clock value), decisions out. ``moves`` is the one part that talks to a cluster (one plan
per move). See ``docs/policies.md``.
"""

from tensorcast.policies.moves import MovePlan, MoveSession, PlanClient, build_move
from tensorcast.policies.prefix_index import PrefixIndex, block_keys
from tensorcast.policies.rebalancer import Move, Rebalancer, SessionInfo
from tensorcast.policies.routers import (
    CacheAware,
    LoadAwareShared,
    PowerOfTwo,
    Request,
    Router,
    least_loaded,
    live,
    load,
)
from tensorcast.policies.sessions import SessionTable, StickySessions

__all__ = [
    "CacheAware",
    "LoadAwareShared",
    "Move",
    "MovePlan",
    "MoveSession",
    "PlanClient",
    "PowerOfTwo",
    "PrefixIndex",
    "Rebalancer",
    "Request",
    "Router",
    "SessionInfo",
    "SessionTable",
    "StickySessions",
    "block_keys",
    "build_move",
    "least_loaded",
    "live",
    "load",
]
