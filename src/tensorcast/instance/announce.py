"""An engine server that TensorCast does not run (``vllm serve`` with the ``TensorCastConnector``) made visible
in ``list_instances()`` under its own URL, so that a router finds its backends there.

Owns: ``announce`` (register an instance, then heartbeat it every ``interval`` with the load its caller reports,
registering again when the global store has forgotten it, as after a restart; a failed heartbeat is logged and
retried at the next tick: the record turns not alive after ``gs.worker_liveness_timeout`` without one, as a worker's
does; registering takes the worker role, since routers send users' requests to what is listed: a client credential
is refused once, logged, and the announcement ends) and ``Announcement`` (the same on a thread and connection of its
own, until stopped). ``instance.runtime`` heartbeats the engines TensorCast runs with ``announce`` too. A record is
never deleted: an instance that stopped reads ``alive=False`` to every caller. Does not own: serving instance calls
(``instance.runtime``), or how routers use the records (``router.discovery``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import msgspec

from tensorcast.client.aio import AsyncClient
from tensorcast.client.loop import LoopThread
from tensorcast.context import CallContext
from tensorcast.errors import InvalidArgument, NotFound, PermissionDenied, TensorCastError
from tensorcast.instance.adaptor import InstanceLoad
from tensorcast.records import InstanceInfo
from tensorcast.wire.plan_messages import InstanceHeartbeat, RegisterInstance

__all__ = ["Announcement", "announce"]

log = logging.getLogger("tensorcast.instance")

async def announce(client: AsyncClient, info: InstanceInfo, interval: float,
                   load: Callable[[], InstanceLoad] | None = None, *, registered: bool = False) -> None:
    """Register ``info`` with ``client``'s cluster (unless ``registered`` already) and heartbeat it every
    ``interval`` seconds until cancelled, with the engine's ``load`` (zero when not given: a router then reads
    the engine's own metrics). Without a ``home_worker``, the record names the worker ``client`` is connected to
    (a router credits the instance with the KV pages the shard homes on that worker's host hold)."""
    if interval <= 0:
        raise InvalidArgument(f"announce interval must be > 0, got {interval}")
    timeout = max(2.0, 3 * interval)
    while True:
        now = load() if load is not None else InstanceLoad()
        try:
            if not registered:
                if not info.home_worker:  # the worker this engine's pages go through: the one its client reaches
                    info = msgspec.structs.replace(info, home_worker=(await client.caller.connect()).server_id)
                await client.caller.call(RegisterInstance(instance=info), CallContext().with_timeout(timeout))
                registered = True
                log.info("instance %s announced at %s", info.instance_id, info.address)
            else:
                await client.caller.call(InstanceHeartbeat(
                    instance_id=info.instance_id, running=now.running, waiting=now.waiting,
                    kv_tokens_used=now.kv_tokens_used, kv_tokens_capacity=now.kv_tokens_capacity),
                    CallContext().with_timeout(timeout))
        except NotFound:
            if registered:  # the global store forgot it (restarted from an older state): register again now
                registered = False
                continue
            log.warning("instance %s: registration failed (not found); retrying in %.1f s", info.instance_id,
                        interval)
        except PermissionDenied as exc:  # routers send users' requests to what is listed: workers' role only
            log.error("instance %s cannot be announced: %s (announcing needs the worker role: the cluster secret "
                      "or a worker credential)", info.instance_id, exc)
            return
        except TensorCastError as exc:
            log.warning("instance %s: heartbeat failed (%s); retrying in %.1f s", info.instance_id, exc, interval)
        await asyncio.sleep(interval)


class Announcement:
    """``announce`` in the background, on a thread of its own with its own connection to the cluster at
    ``address``: the engine server at ``url`` (its OpenAI server, ``http://host:port``) as ``instance_id``
    (default ``ENGINE@URL``), every ``interval`` seconds (default: the workers' heartbeat interval) until
    ``stop()``."""

    def __init__(self, address: str, url: str, *, engine: str, token: str | None = None, instance_id: str = "",
                 interval: float | None = None) -> None:
        if not url.startswith(("http://", "https://")):
            raise InvalidArgument(f"an instance's URL must be http(s)://host:port, not {url!r}")
        if interval is not None and interval <= 0:
            raise InvalidArgument(f"announce interval must be > 0, got {interval}")
        url = url.rstrip("/")
        self.info = InstanceInfo(instance_id=instance_id or f"{engine}@{url}", address=url, home_worker="",
                                 engine=engine)
        self._loop = LoopThread("tensorcast-announce")
        self._client: AsyncClient | None = None
        self._task: asyncio.Future[None] | None = None
        self._loop.run(self._start(address, token, interval))

    async def _start(self, address: str, token: str | None, interval: float | None) -> None:
        self._client = AsyncClient(address, token)
        every = interval if interval is not None else self._client.config.worker.heartbeat_interval
        self._task = asyncio.ensure_future(announce(self._client, self.info, every))

    async def _stop(self) -> None:
        assert self._task is not None and self._client is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, TensorCastError):
            await self._task
        await self._client.close()

    def stop(self) -> None:
        """No more heartbeats: the record turns not alive ``gs.worker_liveness_timeout`` later."""
        if self._task is not None:
            self._loop.run(self._stop())
            self._task = None
            self._loop.stop()
