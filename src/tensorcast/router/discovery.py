"""Backends found in the cluster: the engine servers that announced themselves in ``list_instances()``
(``instance.announce``; ``vllm serve`` with the ``TensorCastConnector`` and an ``advertise_url``).

Owns: which instance records are a router's backends (``backend_urls``: alive, an ``http(s)://`` address, of the
engine asked for), how a router's backends follow the list (``reconcile``: listed ones added; a discovered one
dropped only once it is both unlisted and down, with nothing in flight, so engines that come and go at new
addresses do not pile up) and a ``Discovery`` that asks the cluster for them (one client, opened on first use on
the router's loop). Whether a backend is up is its ``/health``'s answer (``router.service``), so a global store
that is briefly unreachable, or an instance's late heartbeat, takes nothing out of service.
Does not own: the service's backend list or its health checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tensorcast.records import InstanceInfo
from tensorcast.router.choice import BackendLoad

__all__ = ["Discovery", "backend_urls", "reconcile"]


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


class Discovery:
    """``await discovery()``: the backend URLs the cluster at ``address`` lists now (``TensorCastError`` when it
    cannot be asked)."""

    def __init__(self, address: str, token: str | None = None, engine: str = "") -> None:
        self.address, self.token, self.engine = address, token, engine
        self._client: Any = None

    async def __call__(self) -> list[str]:
        from tensorcast.client.aio import connect

        if self._client is None:
            self._client = await connect(self.address, self.token)
        return backend_urls(await self._client.list_instances(), self.engine)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None
