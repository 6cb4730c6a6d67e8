"""Structured logging: one JSON object per line, with the process role and the current trace id.

Owns: the formatter and ``setup_logging``. Every record logged while a request is handled carries that
request's trace id (a context variable set by the RPC layer), so one operation can be followed across
processes with ``grep <trace id>``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from tensorcast.context import current_trace_id

__all__ = ["JsonFormatter", "RateLimitedLog", "setup_logging"]


class JsonFormatter(logging.Formatter):
    def __init__(self, process_name: str) -> None:
        super().__init__()
        self.process_name = process_name

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "proc": self.process_name,
            "pid": os.getpid(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        trace = getattr(record, "trace_id", None) or current_trace_id()
        if trace:
            doc["trace_id"] = trace
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def setup_logging(process_name: str, level: str | None = None, path: str | None = None) -> None:
    handler: logging.Handler = logging.FileHandler(path) if path else logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(process_name))
    root = logging.getLogger("tensorcast")
    root.handlers[:] = [handler]
    root.setLevel((level or os.environ.get("TENSORCAST_LOG_LEVEL", "INFO")).upper())
    root.propagate = False
    logging.Formatter.converter = time.gmtime


class RateLimitedLog:
    """Warnings about things peers can cause at will (refused connections, malformed frames), logged at a
    bounded rate: at most ``burst`` per ``period`` seconds, then one line saying how many were left out."""

    def __init__(self, logger: logging.Logger, burst: int = 5, period: float = 10.0) -> None:
        self.logger = logger
        self.burst = burst
        self.period = period
        self._window = 0.0
        self._count = 0
        self._dropped = 0

    def warning(self, msg: str, *args: object) -> None:
        if self._allowed():
            self.logger.warning(msg, *args)

    def exception(self, msg: str, *args: object) -> None:
        """An error with its traceback (a bug a peer's input reached), at the same bounded rate."""
        if self._allowed():
            self.logger.error(msg, *args, exc_info=True)

    def _allowed(self) -> bool:
        now = time.monotonic()
        if now - self._window >= self.period:
            if self._dropped:
                self.logger.warning("%d more such warnings in the last %.0f s were not logged", self._dropped,
                                    self.period)
            self._window, self._count, self._dropped = now, 0, 0
        if self._count < self.burst:
            self._count += 1
            return True
        self._dropped += 1
        return False
