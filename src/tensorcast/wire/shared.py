"""What every connection of one process shares: the receive budget, fault injection and rate-limited logs.

Owns: ``ReceiveBudget`` (bytes held in fresh receive buffers, process-wide), ``PayloadFaults`` (test fault
injection), ``WireState`` (one of each plus the process's rate-limited warnings) and ``has_bytes_waiting`` (how
both servers tell a silent socket from a peer mid-handshake). Does not own: the
connections (``wire.connection``).
"""

from __future__ import annotations

import logging
import select
import threading

from tensorcast.config import WireConfig
from tensorcast.errors import ResourceExhausted
from tensorcast.log import RateLimitedLog

__all__ = ["BudgetFull", "PayloadFaults", "ReceiveBudget", "WireState", "has_bytes_waiting"]

log = logging.getLogger("tensorcast.wire")


class PayloadFaults:
    """Fault injection for tests (``wire.fault_corrupt_payload_chunks``): corrupt one chunk of each of the
    next N payloads sent, so that receivers' checksum checks and senders' retries are exercised."""

    def __init__(self, payloads: int) -> None:
        self.left = payloads

    def take(self) -> bool:
        if self.left <= 0:
            return False
        self.left -= 1
        return True



class BudgetFull(ResourceExhausted):
    """The process's receive buffers are full (not the peer's fault: another connection holds them)."""


class ReceiveBudget:
    """Bytes all connections of one process hold in frame bodies and payloads still arriving into fresh
    buffers (``wire.receive_budget_bytes``): many peers announcing large frames cannot make the process
    commit more memory than this."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._lock = threading.Lock()  # a synchronous client's threads share it with its event loop

    def take(self, nbytes: int) -> None:
        with self._lock:
            taken = self.held + nbytes <= self.limit
            if taken:
                self.held += nbytes
        if not taken:
            raise BudgetFull(f"receive buffers full: {nbytes} more bytes would exceed "
                             f"wire.receive_budget_bytes ({self.limit}); retry")

    def give(self, nbytes: int) -> None:
        if nbytes:  # (a reader closed between frames gives nothing back: no lock, e.g. from a finalizer)
            with self._lock:
                self.held -= nbytes


class WireState:
    """What every connection of one process (a server, or a caller's channels) shares."""

    def __init__(self, config: WireConfig) -> None:
        self.budget = ReceiveBudget(config.receive_budget_bytes)
        self.faults = PayloadFaults(config.fault_corrupt_payload_chunks)
        # Warnings about what peers can do at will are rate-limited for every connection of the process at
        # once, so that no peer can flood the log: refused connections (the RPC layer), and connections
        # closed for a protocol violation (each kind with its own budget, so that one does not hide the other).
        self.refusals = RateLimitedLog(log)
        self.violations = RateLimitedLog(log)
        self.bugs = RateLimitedLog(log)  # unexpected exceptions a peer's input reached, with tracebacks


def has_bytes_waiting(fd: int) -> bool:
    """Whether bytes (or a close) wait unread on the socket ``fd``, without reading them. A server that accepts
    a burst of connections reads none of them until the burst is in: an honest peer's hello may be waiting
    while a flood of silent sockets arrives behind it."""
    if fd < 0:
        return False
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))
