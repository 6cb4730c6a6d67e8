"""System tools that tests drive (etcd, Prometheus, Chromium, iproute2, nftables): found, or the test is skipped
saying how to install it, or failed where ``TENSORCAST_REQUIRE_SYSTEM_TOOLS=1`` (CI, which installs them all)."""

from __future__ import annotations

import os
import random
import shutil
import socket

__all__ = ["require_tool", "unused_port", "unused_ports"]

# A tool is given a port number, not a socket, so a port found free here can be taken before the tool binds it.
# Ports below Linux's ephemeral range (32768 and up by default) are never handed out for outgoing connections,
# which makes that race rare; callers that must never lose it retry with a fresh port.
_PORT_RANGE = (20000, 32000)


def unused_port() -> int:
    """A loopback TCP port that nothing listens on now, outside the ephemeral range."""
    for _ in range(200):
        port = random.randrange(*_PORT_RANGE)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {_PORT_RANGE}")


def unused_ports(n: int) -> int:
    """The first of ``n`` consecutive loopback TCP ports that nothing listens on now (outside the ephemeral range)."""
    for _ in range(200):
        first = random.randrange(_PORT_RANGE[0], _PORT_RANGE[1] - n)
        socks = []
        try:
            for port in range(first, first + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise OSError(f"no {n} free ports in a row in {_PORT_RANGE}")


def require_tool(path: str, package: str) -> str:
    import pytest

    found = shutil.which(path)
    if found:
        return found
    why = f"{path} not found: apt-get install {package}"
    if os.environ.get("TENSORCAST_REQUIRE_SYSTEM_TOOLS") == "1":
        pytest.fail(why)
    pytest.skip(why)
