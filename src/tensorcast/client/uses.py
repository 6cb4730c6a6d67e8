"""The use records a binding keeps on the weight versions it holds: what protects them from collection.

Owns: one caller-leased artifact per (version, holder) under ``{model}@use/v{N}/{holder}`` (a few bytes,
``pinned`` placement so that memory pressure never evicts it), put before a version is fetched, renewed every
third of its lease, put again if it was lost (its worker restarted), and released when the binding no longer
needs the version. A binding that dies stops renewing: its records expire with their lease and the versions
become collectable. This is the owner/lease model of every artifact, used as a reference count that the
publisher's garbage collection reads (``weights.versions.versions_in_use``). Does not own: deciding which
versions are needed (``client.binding``) or collecting (``client.publisher``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable

from tensorcast.client.publisher import ClientPort
from tensorcast.context import CallContext
from tensorcast.errors import NotFound, TensorCastError
from tensorcast.weights.versions import use_key, use_tag
from tensorcast.wire.messages import ReleaseLease, RenewLease

__all__ = ["UseRecords"]

log = logging.getLogger("tensorcast.weights")


class UseRecords:
    def __init__(self, client: ClientPort, model: str, holder: str, ttl: float) -> None:
        self.client = client
        self.model = model
        self.holder = holder
        self.ttl = ttl
        self.ids: dict[int, str] = {}  # version -> use record's artifact id (its lease is its key's)

    async def hold(self, version: int, ctx: CallContext | None = None) -> None:
        """Record that this holder uses ``version`` (before fetching it: collection sees it from now on)."""
        if version not in self.ids:
            await self._put(version, ctx)

    async def _put(self, version: int, ctx: CallContext | None) -> None:
        art = await self.client.put({"use": use_tag(self.model, version, self.holder)},
                                    use_key(self.model, version, self.holder), ttl=self.ttl, policy="pinned",
                                    ctx=ctx)
        self.ids[version] = art.info.id

    async def keep_only(self, versions: Iterable[int]) -> None:
        """Release the records of every version not in ``versions`` (best effort: unreleased ones expire)."""
        keep = set(versions)
        for version in [v for v in self.ids if v not in keep]:
            aid = self.ids.pop(version)
            with contextlib.suppress(TensorCastError):
                await self.client.caller.call(
                    ReleaseLease(artifact_id=aid, key=use_key(self.model, version, self.holder)),
                    CallContext().with_timeout(10.0))

    async def renew(self) -> None:
        """Extend every record's lease; put again those that were lost."""
        for version, aid in list(self.ids.items()):
            try:
                await self.client.caller.call(
                    RenewLease(artifact_id=aid, ttl=self.ttl, key=use_key(self.model, version, self.holder)),
                    CallContext().with_timeout(max(1.0, self.ttl / 3)))
            except NotFound:
                log.warning("use record of %s version %d for %s was lost: recording it again", self.model,
                            version, self.holder)
                with contextlib.suppress(TensorCastError):
                    await self._put(version, CallContext().with_timeout(max(1.0, self.ttl / 3)))
            except TensorCastError as exc:
                log.warning("renewing the use record of %s version %d failed: %s", self.model, version, exc)
