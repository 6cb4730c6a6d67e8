"""The asyncio API: ``await tensorcast.aio.connect(address)`` returns an ``AsyncClient``."""

from tensorcast.client.aio import AsyncArtifact, AsyncClient, AsyncView, connect

__all__ = ["AsyncArtifact", "AsyncClient", "AsyncView", "connect"]
