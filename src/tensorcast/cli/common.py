"""What every ``tensorcast`` command shares: the consoles, one-line output, ``--set`` overrides and the bind check.

Owns: stdout/stderr consoles (whole cells when piped), ``say`` (one plain line; dropped, not raised, when the
terminal is gone, as after a SIGHUP), turning ``--set KEY=VALUE`` into configuration overrides, and refusing to
bind beyond loopback without a token before a process starts (``credentials.check_bind``; the servers check
again). Does not own: any command (``cli.commands``, ``cli.procs``).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

from rich.console import Console

from tensorcast.config import Config
from tensorcast.credentials import check_bind
from tensorcast.errors import InvalidArgument

__all__ = ["check_binds", "console", "err_console", "overrides", "say"]

# Piped into a file or another program, a table keeps whole cells (rich would cut them to 80 columns).
_piped = not sys.stdout.isatty() and "COLUMNS" not in os.environ
console = Console(width=1000 if _piped else None)
err_console = Console(stderr=True)


def say(line: str) -> None:
    """One plain line on stdout: never wrapped (logs and scripts read it whole), no markup in names. A line
    that cannot be written (the terminal was closed) is dropped: the command carries on, e.g. to stop cleanly."""
    with contextlib.suppress(OSError):
        console.print(line, soft_wrap=True, markup=False, highlight=False)


def overrides(sets: tuple[str, ...], extra: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep:
            raise InvalidArgument(f"--set expects KEY=VALUE, got {item!r}")
        out[key.strip()] = value
    out.update({k: v for k, v in extra.items() if v is not None})
    return out


def check_binds(config: Config, host: str) -> None:
    """Before anything starts: a process without a token listens on loopback only, its RPC and data ports
    (``host``) and its metrics endpoint alike (the servers check it again themselves)."""
    check_bind(host, config.token, "the RPC and data ports")
    if config.metrics.enabled:
        check_bind(config.metrics.host or host, config.token, "the metrics endpoint (metrics.host)")
