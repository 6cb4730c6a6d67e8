"""Control-plane wire protocol: typed messages, frames, connections and RPC."""

from tensorcast.wire.channel import RpcChannel
from tensorcast.wire.messages import PROTOCOL_VERSION
from tensorcast.wire.rpc import HandlerRegistry, Reply, Request, RpcServer, parse_address

__all__ = ["PROTOCOL_VERSION", "HandlerRegistry", "Reply", "Request", "RpcChannel", "RpcServer", "parse_address"]
