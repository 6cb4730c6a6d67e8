"""Choosing a transport by name (``transport.kind``): what workers and clients hold is a ``Transport``.

Owns: the table of implementations. Adding a transport (RDMA, UCX) is one entry here plus its module.
"""

from __future__ import annotations

from collections.abc import Callable

from tensorcast.config import TLSConfig, TransportConfig, WireConfig
from tensorcast.errors import InvalidArgument
from tensorcast.transport.base import Transport
from tensorcast.transport.inproc import InProcTransport
from tensorcast.transport.tcp import TcpTransport

__all__ = ["TRANSPORTS", "make_transport"]

TRANSPORTS: dict[str, Callable[[WireConfig, TransportConfig, str | None, int, TLSConfig | None], Transport]] = {
    "tcp": lambda wire, limits, token, streams, tls: TcpTransport(wire, token=token, max_streams=streams,
                                                                  limits=limits, tls=tls),
    "inproc": lambda wire, limits, token, streams, tls: InProcTransport(),
}


def make_transport(kind: str, wire: WireConfig, *, token: str | None, max_streams: int,
                   limits: TransportConfig | None = None, tls: TLSConfig | None = None) -> Transport:
    """The transport named ``kind`` (``transport.kind``); ``limits``: the data server's connection caps;
    ``tls``: TLS on its connections when enabled."""
    try:
        factory = TRANSPORTS[kind]
    except KeyError:
        raise InvalidArgument(f"transport.kind must be one of {sorted(TRANSPORTS)}, got {kind!r}") from None
    return factory(wire, limits or TransportConfig(), token, max_streams, tls)
