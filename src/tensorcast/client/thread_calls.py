"""Calls a synchronous client makes on the caller's own thread, without its event loop.

Owns: ``ThreadCalls``: a blocking connection per calling thread (``wire.blocking.BlockingChannel``, charged to
the client's receive budget) to the gateway the client's ``Caller`` uses now, opened on that thread's first
call and again after the gateway changed, closed with the client or when its thread ends. A call either
returns the reply, raises the typed error the gateway answered, or returns None when it should go the event
loop's way instead: this way is off, the client is closing, the process forked, or the gateway could not be
reached over such a connection (the loop's caller then fails over to the next gateway as it always does).
After such a failure no thread without a working connection to that gateway tries it this way for a while
(``BACKOFF_S``, doubled on each failure in a row up to ``MAX_BACKOFF_S``, forgotten on a success): a gateway
that refuses new connections (at its connection limit) or is down costs its callers one failed connection per
back-off, not one per lookup. Only requests that may be sent twice go
this way (a lookup), since one whose connection broke is sent again through the loop.

Why: a synchronous call handed to the loop thread wakes that thread, which wakes the caller again when the
reply is in: two wake-ups, each as dear as the round trip itself on a busy host. What it costs: a connection
to the gateway per thread that looks something up (held while the thread lives), beside the loop's own. Does
not own: which calls go this way (``client.sync``) or what they mean (``client.aio``).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import TypeVar

from tensorcast.context import CallContext
from tensorcast.wire.blocking import BlockingChannel
from tensorcast.wire.caller import Caller
from tensorcast.wire.frame_parts import ConnectionLost, NotSent
from tensorcast.wire.messages import Request
from tensorcast.wire.protocol import retry_safe

__all__ = ["BACKOFF_S", "MAX_BACKOFF_S", "ThreadCalls"]

R = TypeVar("R")

BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0


class _Held:
    """One thread's channel; closed when the thread ends (its thread-local storage goes)."""

    __slots__ = ("__weakref__", "channel")

    def __init__(self, channel: BlockingChannel) -> None:
        self.channel = channel

    def __del__(self) -> None:
        self.channel.close()


class ThreadCalls:
    def __init__(self, caller: Caller, *, enabled: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        self.caller = caller
        self.enabled = enabled
        self.clock = clock
        self._pid = os.getpid()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._held: weakref.WeakSet[_Held] = weakref.WeakSet()  # every thread's, to close with the client
        self._closed = False
        self._avoid: dict[str, tuple[float, float]] = {}  # gateway -> (not tried this way until, back-off)

    def call(self, msg: Request[R], ctx: CallContext) -> R | None:
        """``msg``'s reply, sent on this thread; None: send it through the event loop instead."""
        if not self.enabled or self._closed or os.getpid() != self._pid or not retry_safe(msg):
            return None  # (a forked child must not use its parent's sockets: their replies are the parent's)
        address = self.caller.address
        if not address:
            return None
        held: _Held | None = getattr(self._local, "held", None)
        mine = held is not None and held.channel.address == address and held.channel.connected
        avoided = self._avoid.get(address)
        if avoided is not None and not mine and self.clock() < avoided[0]:
            return None  # (a thread whose connection to it works goes on using it)
        if held is None or held.channel.address != address:
            if held is not None:
                held.channel.close()
            held = _Held(BlockingChannel(address, self.caller.config, token=self.caller.token,
                                         peer_id=self.caller.peer_id, host_id=self.caller.host_id,
                                         tls=self.caller.tls, budget=self.caller.budget))
            with self._lock:
                if self._closed:
                    return None
                self._held.add(held)
            self._local.held = held
        try:
            reply = held.channel.call(msg, ctx)
        except (NotSent, ConnectionLost):
            with self._lock:  # the loop's caller fails over (and says so); this way waits a while
                if not self._closed:
                    backoff = BACKOFF_S if avoided is None else min(avoided[1] * 2, MAX_BACKOFF_S)
                    self._avoid[address] = (self.clock() + backoff, backoff)
            return None
        if avoided is not None and not mine:  # a new connection worked: the gateway takes them again
            with self._lock:
                self._avoid.pop(address, None)
        return reply

    def connections(self) -> int:
        """Threads holding an open connection now."""
        with self._lock:
            return sum(1 for h in self._held if h.channel.connected)

    def close(self) -> None:
        """No call goes this way any more; every thread's connection is closed (one mid-call is shut down and
        its call goes through the loop, which says the client is closed)."""
        with self._lock:
            self._closed = True
            held = list(self._held)
        for h in held:
            h.channel.abort()
