"""The router's own requests to its backends, besides forwarding users' requests.

Owns: ``probe`` (whether a backend is up: its ``GET /health``; and the load its engine reports: ``GET /metrics``,
vLLM's running and waiting requests) and ``prompt_tokens`` (a text prompt's token ids from a backend's
``POST /tokenize``, the chat template applied to messages, so that it matches the KV events' token blocks).
Neither raises: a backend that does not answer is down, a prompt no backend tokenizes has no tokens.
Does not own: when they run (``router.service``) or what the load means to a policy (``router.choice``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from tensorcast.router.choice import BackendLoad, reported_load

__all__ = ["probe", "prompt_tokens"]

log = logging.getLogger("tensorcast.router")


async def probe(session: Any, b: BackendLoad, timeout: float = 5.0) -> None:
    """``b.alive`` from its ``/health`` (a change is logged), ``b.reported`` from its ``/metrics``."""
    from aiohttp import ClientError, ClientTimeout

    try:
        async with session.get(b.url + "/health", timeout=ClientTimeout(total=timeout)) as up:
            alive = up.status == 200
        if alive:  # the engine's own count of its requests: every replica's and client's
            async with session.get(b.url + "/metrics", timeout=ClientTimeout(total=timeout)) as up:
                load = reported_load(await up.text()) if up.status == 200 else None
            b.reported = load or 0
    except (TimeoutError, ClientError, OSError):
        alive = False
    if alive != b.alive:
        log.warning("backend %s (%s) is %s", b.backend_id, b.url, "up" if alive else "down")
    b.alive = alive


async def prompt_tokens(session: Any, backends: Sequence[BackendLoad], body: Mapping[str, Any],
                        timeout: float = 10.0) -> tuple[int, ...]:
    """The prompt's token ids, from the first live backend of ``backends`` that tokenizes it; empty when none
    answers (the request is then routed on load alone)."""
    from aiohttp import ClientError, ClientTimeout

    ask = {k: body[k] for k in ("model", "prompt", "messages") if k in body}
    for backend in [b for b in backends if b.alive]:
        try:
            async with session.post(backend.url + "/tokenize", json=ask, timeout=ClientTimeout(total=timeout)) as up:
                if up.status == 200:
                    tokens = (await up.json()).get("tokens")
                    if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
                        return tuple(tokens)
        except (TimeoutError, ClientError, OSError, ValueError):
            continue
    return ()
