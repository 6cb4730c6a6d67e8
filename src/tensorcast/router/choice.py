"""What the router decides, apart from any socket: which policy a name means, what a policy sees of an OpenAI request,
and the load it sees of each backend.

Owns: ``POLICIES`` (the names ``tensorcast router --policy`` accepts, each a factory of a ``policies.Router``: the
same classes the benchmarks and the simulator run, so a policy written for them routes live traffic unchanged),
``route_view`` (an OpenAI request as a ``policies.Request``: its session — the session header, else the OpenAI
``user`` field — and its prompt as the sequence a prefix index matches: token ids when the client sent ids, else
the text's characters, as SGLang's model gateway matches text), and ``as_instances`` (backends as the
``InstanceInfo`` records policies read: ``running`` from this router's requests in flight and the engine's own
metrics, ``reported_load``), and keeping a session's requests together (``HashedSessions``: rendezvous hashing, so
that every router replica sends a session to the same backend without sharing a table). Does not own: HTTP
or health checks (``router.service``).

Adding a policy: ``register_policy("mine", lambda seed: MyRouter())`` before the service starts, or a
``module:factory`` path on the command line (``--policy my_pkg.routing:make``; the factory takes the seed).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import xxhash
from prometheus_client.parser import text_string_to_metric_families

from tensorcast.errors import InvalidArgument
from tensorcast.policies import (
    CacheAware,
    EventCacheAware,
    EventIndex,
    LoadAwareShared,
    PowerOfTwo,
    Request,
    Router,
    StickySessions,
    live,
)
from tensorcast.records import InstanceInfo

__all__ = ["POLICIES", "SESSIONS", "BackendLoad", "HashedSessions", "as_instances", "make_event_policy",
           "make_policy", "register_policy", "reported_load", "route_view", "wants_tokens", "with_sessions"]

PolicyFactory = Callable[[int], Router]


class RoundRobin(Router):
    """Each live backend in turn (the baseline every router ships)."""

    def __init__(self) -> None:
        self.turn = 0

    def choose(self, request: Request, instances: Sequence[InstanceInfo]) -> str:
        alive = live(instances)
        chosen = alive[self.turn % len(alive)]
        self.turn += 1
        return chosen.instance_id


POLICIES: dict[str, PolicyFactory] = {
    "round-robin": lambda seed: RoundRobin(),
    "power-of-two": lambda seed: PowerOfTwo(seed),
    "least-loaded": lambda seed: LoadAwareShared(),
    "cache-aware": lambda seed: CacheAware(),
}


def register_policy(name: str, factory: PolicyFactory) -> None:
    """Make ``--policy NAME`` build ``factory(seed)``."""
    POLICIES[name] = factory


class HashedSessions(Router):
    """A session's requests go to the live backend ranking first for it by rendezvous hashing of its id with
    each backend's URL; requests without a session go to ``router``. Every router replica computes the same
    ranking from the same backends with nothing shared, holds no table (no memory per session), and when a
    backend goes down only its sessions move (each to its next-ranked backend)."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def choose(self, request: Request, instances: Sequence[InstanceInfo]) -> str:
        if not request.session_id:
            return self.router.choose(request, instances)
        key = request.session_id.encode()
        return max(live(instances), key=lambda i: (xxhash.xxh3_64_intdigest(key + b"\0" + i.address.encode()),
                                         i.address)).instance_id

    def route(self, request: Request, instances: Sequence[InstanceInfo]) -> str:
        chosen = self.choose(request, instances)
        self.router.observe(request, chosen)  # a cache-aware index learns where the session's prefix is
        return chosen

    def set_topology(self, workers: Sequence[Any]) -> None:
        self.router.set_topology(workers)


SESSIONS = ("hrw", "table", "off")


def make_policy(name: str, seed: int = 0, *, sessions: str = "hrw") -> Router:
    """The policy ``name`` (or ``module:factory``) with a session's requests kept together: ``hrw``
    (rendezvous hashing: replicas agree, nothing stored), ``table`` (the policy places a session's first
    request, later ones follow it: one replica only), or ``off``."""
    if sessions not in SESSIONS:
        raise InvalidArgument(f"sessions must be one of {', '.join(SESSIONS)}, got {sessions!r}")
    if name == "event-cache-aware":
        raise InvalidArgument("event-cache-aware needs the engines' KV events: make_event_policy (CLI: --kv-events, "
                              "and --address for the pool's)")
    if name in POLICIES:
        router = POLICIES[name](seed)
    elif ":" in name:
        module, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise InvalidArgument(f"policy {name!r}: {exc}") from None
        router = factory(seed)
        if not isinstance(router, Router):
            raise InvalidArgument(f"policy {name!r} built a {type(router).__name__}, not a policies.Router")
    else:
        raise InvalidArgument(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}, or module:factory")
    return with_sessions(router, sessions)


def make_event_policy(block_size: int, sessions: str = "hrw") -> tuple[Router, EventIndex]:
    """``event-cache-aware``: ``policies.EventCacheAware`` over a fresh ``EventIndex`` of ``block_size``-token
    blocks (the engines' block size), which the caller feeds the engines' KV events (``policies.EventFeed``)."""
    index = EventIndex(block_size)
    return with_sessions(EventCacheAware(index), sessions), index


def with_sessions(router: Router, sessions: str) -> Router:
    """``router`` with a session's requests kept together (``make_policy``'s ``sessions``)."""
    if sessions not in SESSIONS:
        raise InvalidArgument(f"sessions must be one of {', '.join(SESSIONS)}, got {sessions!r}")
    return HashedSessions(router) if sessions == "hrw" else StickySessions(router) if sessions == "table" else router


def wants_tokens(body: Mapping[str, Any]) -> bool:
    """Whether the request's prompt is text (a chat, or a string) rather than token ids."""
    return isinstance(body.get("prompt"), str) or isinstance(body.get("messages"), list)


def route_view(body: Mapping[str, Any], session: str = "") -> Request:
    """What a policy sees of an OpenAI completion or chat request."""
    session = session or str(body.get("user") or "")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):  # a batch: its first prompt
        prompt = prompt[0]
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return Request(session, tuple(prompt))
    if isinstance(prompt, str):
        return Request(session, _chars(prompt))
    messages = body.get("messages")
    if isinstance(messages, list):
        text = "".join(f"{m.get('role', '')}:{_content(m.get('content'))}\n" for m in messages if isinstance(m, dict))
        return Request(session, _chars(text))
    return Request(session, ())


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # parts: the text ones
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def _chars(text: str) -> tuple[int, ...]:
    return tuple(map(ord, text))


class BackendLoad:
    """One backend as a policy sees it: requests in flight through this router, the running and waiting
    requests the engine last reported (its own metrics: those of every router replica and direct client),
    whether it is up, and its home worker (the pool worker on its host, when the cluster lists it; "" else)."""

    __slots__ = ("alive", "backend_id", "home_worker", "in_flight", "reported", "url")

    def __init__(self, backend_id: str, url: str) -> None:
        self.backend_id = backend_id
        self.url = url
        self.in_flight = 0
        self.reported = 0
        self.alive = True
        self.home_worker = ""


def as_instances(backends: Sequence[BackendLoad], resident: Mapping[str, int] | None = None) -> list[InstanceInfo]:
    """Backends as ``InstanceInfo``: ``running`` is the larger of this router's requests in flight (current)
    and the engine's last report (every replica's, but as old as the last poll); ``kv_tokens_used`` the context
    of the sessions this router has on it (``resident``, by backend id): between two turns an agent's session
    is no request at all, yet its next turn will come, so least-loaded placement breaks ties of requests toward
    the backend holding fewer sessions' tokens instead of piling new sessions onto the first one."""
    resident = resident or {}
    return [InstanceInfo(instance_id=b.backend_id, address=b.url, home_worker=b.home_worker, running=max(b.in_flight,
                         b.reported), kv_tokens_used=resident.get(b.backend_id, 0), alive=b.alive, engine="openai")
            for b in backends]


_LOAD_SERIES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def reported_load(metrics_text: str) -> int | None:
    """Running plus waiting requests in an engine's Prometheus text (vLLM's series, summed over their labels);
    None when it has neither (another engine: the router's own count stands alone)."""
    try:
        values = [s.value for family in text_string_to_metric_families(metrics_text) for s in family.samples
                  if s.name in _LOAD_SERIES]
    except ValueError:  # not Prometheus text
        return None
    return int(sum(values)) if values else None
