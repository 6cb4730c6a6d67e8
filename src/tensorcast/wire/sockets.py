"""Socket options every control connection gets.

Owns: dead-peer detection (``detect_dead_peer``): the kernel closes a connection whose peer's host stopped
answering, so that a call fails over instead of waiting out its deadline on a partitioned peer. Does not
own: the connections themselves (``wire.connection``).
"""

from __future__ import annotations

import contextlib
import socket

__all__ = ["detect_dead_peer"]


def detect_dead_peer(sock: socket.socket, seconds: float) -> None:
    """Have the kernel close ``sock`` when its peer stops answering for about ``seconds``: keepalive probes
    after a third of it idle, and TCP_USER_TIMEOUT for data left unacknowledged (Linux; elsewhere only what
    the platform has)."""
    idle = max(1, int(seconds / 3))
    interval = max(1, int(seconds / 6))
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, max(1, int((seconds - idle) / interval)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(seconds * 1000))
