"""Caller SDK: synchronous ``Client``/``Artifact`` and their asyncio twins."""

from tensorcast.client.aio import AsyncArtifact, AsyncClient
from tensorcast.client.sync import Artifact, Client, connect, get_client, init

__all__ = ["Artifact", "AsyncArtifact", "AsyncClient", "Client", "connect", "get_client", "init"]
