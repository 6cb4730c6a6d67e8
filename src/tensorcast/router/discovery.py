"""What a router reads from the cluster: its backends (the engine servers that announced themselves in
``list_instances()``: ``instance.announce``; ``vllm serve`` with the ``TensorCastConnector`` and an
``advertise_url``), each backend's home worker (the pool worker on its host, from the same records) and the
pool's workers (``list_workers()``: where the shard homes are, for routing by the pool's KV presence).

Owns: which instance records are a router's backends (``backend_urls``: alive, an ``http(s)://`` address, of the
engine asked for), which worker is a backend's home (``home_workers``), how a router's backends follow the list
(``reconcile``: listed ones added; a discovered one dropped only once it is both unlisted and down, with nothing in
flight, so engines that come and go at new addresses do not pile up) and a ``Discovery`` that asks the cluster
(one client, opened on first use on the router's loop). Whether a backend is up is its ``/health``'s answer
(``router.service``), so a global store that is briefly unreachable, or an instance's late heartbeat, takes
nothing out of service. Does not own: the service's backend list, its health checks, or following event streams.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from tensorcast.config import Config, default_host_id
from tensorcast.records import InstanceInfo, WorkerInfo
from tensorcast.router.choice import BackendLoad

__all__ = ["Discovery", "adopt", "backend_urls", "home_workers", "reconcile"]

log = logging.getLogger("tensorcast.router")


def backend_urls(instances: Sequence[InstanceInfo], engine: str = "") -> list[str]:
    """The OpenAI servers' URLs among ``instances``: alive records whose address is ``http(s)://...``, of
    ``engine`` when given (``vllm``), in the records' order."""
    urls = [i.address.rstrip("/") for i in instances
            if i.alive and i.address.startswith(("http://", "https://")) and (not engine or i.engine == engine)]
    return list(dict.fromkeys(urls))


def reconcile(backends: Sequence[BackendLoad], listed: Sequence[str],
              discovered: set[str]) -> tuple[list[str], list[BackendLoad]]:
    """The URLs ``listed`` that no backend has (to add), and the backends that discovery added (their URLs in
    ``discovered``) that are no longer listed, down, and idle (to drop). Backends given by hand always stay."""
    known = {b.url for b in backends}
    listed_now = set(listed)
    added = [u for u in dict.fromkeys(listed) if u not in known]
    dropped = [b for b in backends if b.url in discovered and b.url not in listed_now and not b.alive
               and not b.in_flight]
    return added, dropped


def adopt(backends: list[BackendLoad], listed: Sequence[str], discovered: set[str],
          new_id: Callable[[], str]) -> None:
    """``reconcile`` carried out on ``backends`` (and ``discovered``, the URLs discovery added), each added
    backend under a fresh id (``new_id``)."""
    added, dropped = reconcile(backends, listed, discovered)
    for backend in dropped:
        backends.remove(backend)
        discovered.discard(backend.url)
        log.info("dropped backend %s (%s): down and no longer listed", backend.backend_id, backend.url)
    for url in added:
        backend = BackendLoad(new_id(), url)
        backends.append(backend)
        discovered.add(url)
        log.info("discovered backend %s (%s)", backend.backend_id, url)


def home_workers(instances: Sequence[InstanceInfo]) -> dict[str, str]:
    """Each announced server's URL and the worker on its host that its engine stores through (its home), the
    live records' over the dead ones' (an engine restarted at the same URL), else the latest listed."""
    homes: dict[str, str] = {}
    for alive in (False, True):
        homes.update((i.address.rstrip("/"), i.home_worker) for i in instances
                     if i.alive == alive and i.home_worker and i.address.startswith(("http://", "https://")))
    return homes


class Discovery:
    """The cluster at ``address``, read by a router: ``await survey()`` is its instance records and workers
    (``TensorCastError`` when it cannot be asked); ``adds_backends`` (``--discover``): the announced servers
    of ``engine`` become backends (``backend_urls``), else the cluster is only read for each backend's home
    worker and the shard homes."""

    def __init__(self, address: str, token: str | None = None, engine: str = "", *,
                 adds_backends: bool = True, host_id: str = "") -> None:
        """``host_id``: the router's host (default: this machine's, or ``client.host_id``): which shard homes'
        streams it can reach (``EventFeed.follow_workers``)."""
        self.address, self.token, self.engine = address, token, engine
        self.adds_backends = adds_backends
        self.config = Config.load(overrides={"client.host_id": host_id} if host_id else None)
        self.host_id = self.config.client.host_id or default_host_id()
        self._client: Any = None

    async def survey(self) -> tuple[list[InstanceInfo], list[WorkerInfo]]:
        from tensorcast.client.aio import connect

        if self._client is None:
            self._client = await connect(self.address, self.token, config=self.config)
        return await self._client.list_instances(), await self._client.list_workers()

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None
