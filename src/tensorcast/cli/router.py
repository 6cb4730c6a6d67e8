"""``tensorcast router``: the OpenAI-compatible router service in the foreground (``router.service``)."""

from __future__ import annotations

import asyncio
import signal

import click

from tensorcast.cli.common import say
from tensorcast.router.choice import POLICIES, make_policy


@click.command()
@click.option("--backend", "backends", multiple=True, required=True, metavar="URL",
              help="An engine's OpenAI server (http://host:port); repeat for each.")
@click.option("--policy", default="power-of-two", show_default=True,
              help=f"How to pick a backend: {', '.join(POLICIES)}, or module:factory (your own policies.Router).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--session-header", default="x-session-id", show_default=True,
              help="The header naming a request's session (else the OpenAI 'user' field); a session sticks.")
@click.option("--no-sessions", is_flag=True, help="Route every request on its own, sessions or not.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of randomized policies.")
def router(backends: tuple[str, ...], policy: str, host: str, port: int, session_header: str, no_sessions: bool,
           seed: int) -> None:
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics) in front of
    the BACKEND engine servers, each request to the one POLICY picks. Runs until interrupted."""
    from tensorcast.router.service import RouterService

    service = RouterService(list(backends), make_policy(policy, seed, sessions=not no_sessions), host=host,
                            port=port, session_header=session_header)

    async def run() -> None:
        await service.start()
        say(f"router on {service.url}: {len(backends)} backends, policy {policy}")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await service.stop()

    asyncio.run(run())
