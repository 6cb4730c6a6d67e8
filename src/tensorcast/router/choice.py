"""What the router decides, apart from any socket: which policy a name means, what a policy sees of an
OpenAI request, and the load it sees of each backend.

Owns: ``POLICIES`` (the names ``tensorcast router --policy`` accepts, each a factory of a ``policies.Router``:
the same classes the benchmarks and the simulator run, so a policy written for them routes live traffic
unchanged), ``route_view`` (an OpenAI request as a ``policies.Request``: its session — the session header,
else the OpenAI ``user`` field — and its prompt as the sequence a prefix index matches: token ids when the
client sent ids, else the text's characters, as SGLang's model gateway matches text), and ``as_instances``
(backends as the ``InstanceInfo`` records policies read: a backend's requests in flight through this router
are its ``running``). Does not own: HTTP (``router.service``) or health (``router.backends``).

Adding a policy: ``register_policy("mine", lambda seed: MyRouter())`` before the service starts, or a
``module:factory`` path on the command line (``--policy my_pkg.routing:make``; the factory takes the seed).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tensorcast.errors import InvalidArgument, Unavailable
from tensorcast.policies import CacheAware, LoadAwareShared, PowerOfTwo, Request, Router, StickySessions
from tensorcast.records import InstanceInfo

__all__ = ["POLICIES", "BackendLoad", "as_instances", "make_policy", "register_policy", "route_view"]

PolicyFactory = Callable[[int], Router]


class RoundRobin(Router):
    """Each live backend in turn (the baseline every router ships)."""

    def __init__(self) -> None:
        self.turn = 0

    def choose(self, request: Request, instances: Sequence[InstanceInfo]) -> str:
        alive = [i for i in instances if i.alive]
        if not alive:
            raise Unavailable("no live backend to route to")
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


def make_policy(name: str, seed: int = 0, *, sessions: bool = True) -> Router:
    """The policy ``name`` (or ``module:factory``), sticky per session unless ``sessions`` is False."""
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
    return StickySessions(router) if sessions else router


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
    """One backend as a policy sees it: requests in flight through this router, and whether it is up."""

    __slots__ = ("alive", "backend_id", "in_flight", "url")

    def __init__(self, backend_id: str, url: str) -> None:
        self.backend_id = backend_id
        self.url = url
        self.in_flight = 0
        self.alive = True


def as_instances(backends: Sequence[BackendLoad]) -> list[InstanceInfo]:
    return [InstanceInfo(instance_id=b.backend_id, address=b.url, home_worker="", running=b.in_flight,
                         alive=b.alive, engine="openai") for b in backends]
