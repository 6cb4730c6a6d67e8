"""Backends found in the cluster: the engine servers that announced themselves in ``list_instances()``
(``instance.announce``; ``vllm serve`` with the ``TensorCastConnector`` and an ``advertise_url``).

Owns: which instance records are a router's backends (``backend_urls``: alive, an ``http(s)://`` address, of the
engine asked for) and a ``Discovery`` that asks the cluster for them (one client, opened on first use on the
router's loop). Discovery only adds backends: whether one is up is its ``/health``'s answer (``router.service``),
so a global store that is briefly unreachable, or an instance's late heartbeat, takes nothing out of service.
Does not own: the service's backend list or its health checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tensorcast.records import InstanceInfo

__all__ = ["Discovery", "backend_urls"]


def backend_urls(instances: Sequence[InstanceInfo], engine: str = "") -> list[str]:
    """The OpenAI servers' URLs among ``instances``: alive records whose address is ``http(s)://...``, of
    ``engine`` when given (``vllm``), in the records' order."""
    urls = [i.address.rstrip("/") for i in instances
            if i.alive and i.address.startswith(("http://", "https://")) and (not engine or i.engine == engine)]
    return list(dict.fromkeys(urls))


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
