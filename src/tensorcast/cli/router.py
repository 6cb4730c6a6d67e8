"""``tensorcast router``: the OpenAI-compatible router service in the foreground (``router.service``)."""

from __future__ import annotations

import asyncio
import secrets
import signal

import click

from tensorcast.cli.common import say
from tensorcast.client.loop import new_event_loop
from tensorcast.config import KVConfig
from tensorcast.errors import InvalidArgument
from tensorcast.log import setup_logging
from tensorcast.policies import EventFeed, Rebalancer, Router
from tensorcast.router.choice import POLICIES, SESSIONS, make_event_policy, make_policy


@click.command()
@click.option("--backend", "backends", multiple=True, metavar="URL",
              help="An engine's OpenAI server (http://host:port); repeat for each.")
@click.option("--discover", is_flag=True,
              help="Also route to the engine servers the cluster lists (list_instances(): vLLM with the "
                   "TensorCastConnector and an advertise_url), found as they start.")
@click.option("--address", envvar="TENSORCAST_ADDRESS", default="", metavar="HOST:PORT",
              help="The cluster's gateway (default: TENSORCAST_ADDRESS): where --discover finds backends, and where "
                   "the router reads each backend's home worker and the pool's workers (event-cache-aware also "
                   "follows the shard homes' KV events).")
@click.option("--token", envvar="TENSORCAST_TOKEN", default=None, help="With --address: the cluster's token.")
@click.option("--prefill", "prefill", multiple=True, metavar="URL",
              help="Disaggregated mode: a prefill instance (kv_producer; repeat for each); --backend are then the "
                   "decode instances (kv_consumer), the KV handed over through the pool.")
@click.option("--policy", default="power-of-two", show_default=True,
              help=f"How to pick a backend: {', '.join(POLICIES)}, event-cache-aware (with --kv-events), or "
                   "module:factory (your own policies.Router).")
@click.option("--kv-events", "kv_events", multiple=True, metavar="URL=ENDPOINT[,REPLAY]",
              help="With --policy event-cache-aware: a backend's KV event stream (vLLM's kv_events_config "
                   "endpoint, ZeroMQ), and optionally its replay endpoint; repeat for each backend.")
@click.option("--kv-block-size", default=16, show_default=True, type=int,
              help="With --policy event-cache-aware: the engines' KV block size in tokens.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--session-header", default="x-session-id", show_default=True,
              help="The header naming a request's session (else the OpenAI 'user' field); a session sticks.")
@click.option("--sessions", type=click.Choice(SESSIONS), default="hrw", show_default=True,
              help="Keep a session's requests together: hrw (rendezvous hashing: every replica agrees), table "
                   "(the policy places a session's first request: one replica), off.")
@click.option("--rebalance", is_flag=True,
              help="Move idle sessions off the most loaded backend (policies.Rebalancer: their next turns go to "
                   "the new one, which loads their KV from the pool with the TensorCastConnector).")
@click.option("--seed", default=None, type=int,
              help="Seed of randomized policies (default: a random one, so that replicas do not herd together).")
def router(backends: tuple[str, ...], discover: bool, address: str, token: str | None, prefill: tuple[str, ...],
           policy: str, kv_events: tuple[str, ...], kv_block_size: int, host: str, port: int, session_header: str,
           sessions: str, rebalance: bool, seed: int | None) -> None:
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics) in front of
    the BACKEND engine servers, each request to the one POLICY picks. Runs until interrupted."""
    from tensorcast.router.discovery import Discovery
    from tensorcast.router.service import RouterService

    setup_logging("router")  # JSON lines on stderr (TENSORCAST_LOG_LEVEL), as the other processes'

    if not backends and not discover:
        raise InvalidArgument("give the backends (--backend URL, repeated) or --discover them in a cluster")
    if discover and not address:
        raise InvalidArgument("--discover needs the cluster's address (--address or TENSORCAST_ADDRESS)")
    if discover and prefill:
        raise InvalidArgument("--discover finds plain backends: give --prefill pools as URLs")
    seed = seed if seed is not None else secrets.randbits(32)
    feed = None
    if policy == "event-cache-aware":
        chosen, feed = _event_policy(list(backends), kv_events, kv_block_size, sessions)
    elif kv_events:
        raise InvalidArgument("--kv-events feeds --policy event-cache-aware only")
    else:
        chosen = make_policy(policy, seed, sessions=sessions)
    service = RouterService(list(backends), chosen, host=host, port=port, session_header=session_header,
                            prefill=list(prefill), feed=feed, rebalancer=Rebalancer() if rebalance else None,
                            discovery=Discovery(address, token, adds_backends=discover) if address else None,
                            prefill_policy=make_policy("power-of-two" if feed else policy, seed + 1,
                                                       sessions=sessions) if prefill else None)

    async def run() -> None:
        try:
            await service.start()
            pools = f"{len(prefill)} prefill + {len(backends)} decode backends" if prefill \
                else f"{len(backends)} backends"
            say(f"router on {service.url}: {pools}, policy {policy}")
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
        finally:  # also when start() failed half-way: its port and threads are released
            await service.stop()

    with asyncio.Runner(loop_factory=new_event_loop) as runner:  # uvloop where installed
        runner.run(run())


def _event_policy(backends: list[str], streams: tuple[str, ...], block_size: int,
                  sessions: str) -> tuple[Router, EventFeed]:
    """``event-cache-aware`` and the feed of its backends' KV event streams (``URL=ENDPOINT[,REPLAY]``), which
    also follows the pool's shard homes when the router reads a cluster (``--address``)."""
    urls = [b.rstrip("/") for b in backends]
    chosen, index = make_event_policy(block_size, sessions)
    feed = EventFeed(index, topic=KVConfig().events_topic)  # the homes' topic; an engine's stream is added with ""
    for spec in streams:
        url, _, endpoints = spec.partition("=")
        endpoint, _, replay = endpoints.partition(",")
        if url.rstrip("/") not in urls or not endpoint:
            raise InvalidArgument(f"--kv-events {spec!r}: expected BACKEND_URL=ENDPOINT[,REPLAY] of a --backend")
        feed.add_instance(f"b{urls.index(url.rstrip('/'))}", endpoint, replay or None)
    if not streams:  # the pool's events name block hashes, never tokens: an engine's own events chain them
        raise InvalidArgument("--policy event-cache-aware needs the backends' --kv-events (the pool's shard homes' "
                              "events, with --address, add to them: they name no tokens)")
    return chosen, feed
