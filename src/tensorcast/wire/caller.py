"""The one typed call path every TensorCast process uses to talk to another.

Owns: ``Caller`` — a connection per peer address (opened on first use, re-opened after a loss), the
default deadline of a call, checking each reply against the type the request declares (``Request[Reply]``), so
that no caller inspects frames or asserts reply types itself, and fail-over between the equivalent
peers a call goes to by default (a client's gateways, the global-store processes): when the current one
cannot be reached, the call moves to the next and is sent again — any request that was never sent, and a
request that may be repeated (``retry_safe``) when the connection was lost before its reply — within
the call's deadline. Clients, the KV client, the reader, a worker's global-store link, its calls to
other workers and to instances all hold one. Does not own: which peers are equivalent (the owner says,
``set_defaults``), or retries of anything else.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, TypeVar, cast

from tensorcast.config import TLSConfig, WireConfig
from tensorcast.context import CallContext
from tensorcast.errors import InvalidArgument
from tensorcast.wire.channel import RpcChannel
from tensorcast.wire.connection import Sink
from tensorcast.wire.frame_parts import checked_reply
from tensorcast.wire.messages import Request, Welcome
from tensorcast.wire.protocol import retry_safe
from tensorcast.wire.rpc import ConnectionLost, NotSent, ReplySink
from tensorcast.wire.shared import WireState

__all__ = ["Caller"]

log = logging.getLogger("tensorcast.rpc")
R = TypeVar("R")


class Caller:
    """Typed requests to any peer. ``address`` is the default peer, or several equivalent ones (a client's
    gateways) tried in turn; ``timeout`` the default time a call may take when its context has no deadline;
    ``tls`` the process's TLS configuration (every connection uses it when enabled)."""

    def __init__(self, config: WireConfig, *, token: str | None, peer_id: str, host_id: str,
                 address: str | Sequence[str] = "", timeout: float | None = None,
                 tls: TLSConfig | None = None) -> None:
        self.config = config
        self.token = token
        self.tls = tls
        self.peer_id = peer_id
        self.host_id = host_id
        self.timeout = timeout
        self.defaults: list[str] = [address] if isinstance(address, str) else list(address)
        self.defaults = [a for a in self.defaults if a]
        self.address = self.defaults[0] if self.defaults else ""  # the default peer in use now
        self._channels: dict[str, RpcChannel] = {}
        self._shared = WireState(config)  # one receive budget and fault injector for all its connections
        self.budget = self._shared.budget  # (shared with the blocking connections of ``client.thread_calls``)

    def context(self, timeout: float | None = None, ctx: CallContext | None = None) -> CallContext:
        """``ctx`` (or a fresh context) with a deadline: ``timeout`` from now, else the default timeout,
        never later than a deadline ``ctx`` already has."""
        base = ctx or CallContext()
        if timeout is None and base.deadline is None:
            timeout = self.timeout
        return base.with_timeout(timeout)

    def set_defaults(self, addresses: Sequence[str]) -> None:
        """The equivalent default peers (e.g. every live gateway), in order of preference; the one in use
        stays in use."""
        merged = list(dict.fromkeys([self.address, *self.defaults, *addresses]))
        self.defaults = [a for a in merged if a]

    def _channel(self, address: str) -> RpcChannel:
        ch = self._channels.get(address)
        if ch is None:
            ch = RpcChannel(address, self.config, token=self.token, peer_id=self.peer_id, host_id=self.host_id,
                            shared=self._shared, tls=self.tls)
            self._channels[address] = ch
        return ch

    async def connect(self, address: str | None = None) -> Welcome:
        """Open (or reuse) the connection to ``address`` (default: the default peer) and return its
        handshake reply."""
        if address is not None:
            return await self._channel(address).connect()
        welcome: Welcome = await self._to_defaults(lambda a: self._channel(a).connect(), None)
        return welcome

    async def call(self, msg: Request[R], ctx: CallContext | None = None, *, address: str | None = None,
                   payload: Sink | None = None, sink: ReplySink | None = None) -> R:
        """Send ``msg`` and return its reply, of the type the request declares. Raises the typed error the peer
        reported, ``DeadlineExceeded`` past the context's deadline, ``Unavailable`` if no peer that could
        take it can be reached, and ``InternalError`` for a reply of the wrong type. With ``address`` the
        call goes there and nowhere else."""
        ctx = ctx or self.context()

        async def send(target: str) -> R:
            frame = await self._channel(target).call(msg, ctx, payload=payload, sink=sink)
            return cast(R, checked_reply(msg, frame.message, target, frame.envelope.trace_id))

        if address is not None:
            return await send(address)
        reply: R = await self._to_defaults(send, msg)
        return reply

    async def _to_defaults(self, send: Any, msg: Any) -> Any:
        """``send(address)`` to the default peer in use; on to the next one while it cannot be reached."""
        if not self.address:
            raise InvalidArgument("no peer address to call")
        tried: set[str] = set()
        while True:
            target = self.address
            try:
                return await send(target)
            except (NotSent, ConnectionLost) as exc:
                if isinstance(exc, ConnectionLost) and not (msg is None or retry_safe(msg)):
                    raise
                tried.add(target)
                nxt = next((a for a in self.defaults if a not in tried), None)
                if nxt is None:
                    raise
                if self.address == target:  # not moved on by a concurrent call already
                    log.warning("%s unreachable (%s): continuing with %s", target, exc.message, nxt)
                    self.address = nxt

    def fail_over(self, dead: str) -> bool:
        """``dead`` (a default peer) could not be reached: use the next one. False when there is none."""
        if self.address != dead:
            return True  # moved on already
        nxt = next((a for a in self.defaults if a != dead), None)
        if nxt is None:
            return False
        self.address = nxt
        return True

    async def forward(self, msg: Any, ctx: CallContext, *, address: str | None = None) -> Any:
        """Send a request of any type and return its reply, checked against its declared type (a gateway
        relaying a caller's metadata request)."""
        if not isinstance(msg, Request):
            raise InvalidArgument(f"{type(msg).__name__} is not a request")
        return await self.call(msg, ctx, address=address)

    async def drop(self, address: str) -> None:
        """Close the connection to ``address`` (a peer that left)."""
        ch = self._channels.pop(address, None)
        if ch is not None:
            await ch.close()

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
