"""The one typed call path every TensorCast process uses to talk to another.

Owns: ``Caller`` — a connection per peer address (opened on first use, re-opened after a loss), the
default deadline of a call, and checking each reply against the type the request expects (``REPLY_TO``),
so that no caller inspects frames or asserts reply types itself. Clients, the KV client, the reader, a
worker's global-store link, its calls to other workers and to instances all hold one. Does not own:
retries or fail-over policy (the callers decide what is safe to repeat), or the frames themselves
(``wire.rpc``).
"""

from __future__ import annotations

from typing import Any, TypeVar

from tensorcast.config import WireConfig
from tensorcast.context import CallContext
from tensorcast.errors import InternalError, InvalidArgument
from tensorcast.wire.connection import Sink, WireState
from tensorcast.wire.messages import Welcome
from tensorcast.wire.protocol import REPLY_TO
from tensorcast.wire.rpc import ReplySink, RpcChannel

__all__ = ["Caller"]

T = TypeVar("T")


class Caller:
    """Typed requests to any peer. ``address`` is the default peer (a client's gateway, a worker's global
    store); ``timeout`` the default time a call may take when its context has no deadline."""

    def __init__(self, config: WireConfig, *, token: str | None, peer_id: str, host_id: str, address: str = "",
                 timeout: float | None = None) -> None:
        self.config = config
        self.token = token
        self.peer_id = peer_id
        self.host_id = host_id
        self.address = address
        self.timeout = timeout
        self._channels: dict[str, RpcChannel] = {}
        self._shared = WireState(config)  # one receive budget and fault injector for all its connections

    def context(self, timeout: float | None = None, ctx: CallContext | None = None) -> CallContext:
        """``ctx`` (or a fresh context) with a deadline: ``timeout`` from now, else the default timeout,
        never later than a deadline ``ctx`` already has."""
        base = ctx or CallContext()
        if timeout is None and base.deadline is None:
            timeout = self.timeout
        return base.with_timeout(timeout)

    def _channel(self, address: str) -> RpcChannel:
        ch = self._channels.get(address)
        if ch is None:
            ch = RpcChannel(address, self.config, token=self.token, peer_id=self.peer_id, host_id=self.host_id,
                            shared=self._shared)
            self._channels[address] = ch
        return ch

    def _target(self, address: str | None) -> str:
        target = address or self.address
        if not target:
            raise InvalidArgument("no peer address to call")
        return target

    async def connect(self, address: str | None = None) -> Welcome:
        """Open (or reuse) the connection to ``address`` and return the peer's handshake reply."""
        return await self._channel(self._target(address)).connect()

    async def call(self, msg: Any, expect: type[T], ctx: CallContext | None = None, *, address: str | None = None,
                   payload: Sink | None = None, sink: ReplySink | None = None) -> T:
        """Send ``msg`` and return its reply, which must be an ``expect``. Raises the typed error the peer
        reported, ``DeadlineExceeded`` past the context's deadline, ``Unavailable`` if the peer cannot be
        reached, and ``InternalError`` for a reply of the wrong type."""
        target = self._target(address)
        frame = await self._channel(target).call(msg, ctx or self.context(), payload=payload, sink=sink)
        reply = frame.message
        if not isinstance(reply, expect):
            raise InternalError(f"{target} answered {type(msg).__name__} with {type(reply).__name__}, expected "
                                f"{expect.__name__}", trace_id=frame.envelope.trace_id)
        return reply

    async def forward(self, msg: Any, ctx: CallContext, *, address: str | None = None) -> Any:
        """Send a request of any type and return its reply, checked against ``REPLY_TO`` (a gateway relaying
        a caller's metadata request)."""
        expect = REPLY_TO.get(type(msg))
        if expect is None:
            raise InvalidArgument(f"{type(msg).__name__} is not a request")
        return await self.call(msg, expect, ctx, address=address)

    async def drop(self, address: str) -> None:
        """Close the connection to ``address`` (a peer that left)."""
        ch = self._channels.pop(address, None)
        if ch is not None:
            await ch.close()

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
