"""Caller policies over the public API: routers, sticky sessions, the rebalancer, and executing its moves.

Owns nothing itself; re-exports the policy modules. Decisions (``routers``, ``prefix_index``, ``sessions``,
``rebalancer``, ``kv_event_index``, ``event_router``) are pure: recorded signals in (``InstanceInfo`` from
``Client.list_instances()``, requests, session records, KV events, a clock value), decisions out. ``moves``
talks to a cluster (one plan per move), and ``event_feed`` follows KV event streams. See ``docs/policies.md``.
"""

from tensorcast.policies.event_feed import EventFeed
from tensorcast.policies.event_router import EventCacheAware
from tensorcast.policies.kv_event_index import EventIndex
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
    "EventCacheAware",
    "EventFeed",
    "EventIndex",
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
