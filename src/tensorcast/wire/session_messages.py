"""What opens a connection, the generic replies, and the data plane's range request: the messages every
connection uses before (or besides) any role's requests.

Owns: the protocol version, the control plane's handshake (``Hello``, ``Challenge``, ``Proof``, ``Welcome``),
``Ack`` and ``ErrorReply``, and the data plane's opening and range request (``DataHello``, ``DataRequest``,
``DataReply``; ``transport.tcp``). Does not own: the handshake's logic (``wire.handshake``), the envelope or the
tables derived from the messages (``wire.protocol``), or the other messages (``wire.messages`` lists them all).
"""

from __future__ import annotations

from typing import ClassVar

from tensorcast.records import SliceSpec
from tensorcast.wire.message_base import Msg, Request

# 2: records moved out of messages; ArtifactInfo travels inside ArtifactReply; payload checksums.
# 3: small puts in one request (PutBegin.inline with the bytes as its payload; PutPlan.artifact).
# 5: keys are independent references. 6: challenge-response handshake (Challenge, Proof); credentials carry roles.
# 7: Heartbeat carries the worker's load as one record (WorkerLoad).
PROTOCOL_VERSION = 7


# --------------------------------------------------------------------------- connection set-up


class Hello(Request["Welcome"]):
    """Opens a connection. ``role``: the credential's role ("" without one), ``nonce`` the caller's fresh
    random bytes; the credential itself never travels (``wire.handshake``)."""

    protocol_version: int
    role: str = ""
    nonce: bytes = b""
    peer_id: str = ""
    host_id: str = ""


class Challenge(Msg):
    """Server -> caller, to a ``Hello`` with a role: the server's fresh ``nonce``, and its ``proof`` that it
    holds the role's key (an HMAC over both nonces and the context)."""

    nonce: bytes
    server_id: str = ""
    proof: bytes = b""


class Proof(Request["Welcome"]):
    """Caller -> server, answering a ``Challenge``: the HMAC of the role's key over this connection's nonces and
    context. The reply is ``Welcome`` (``DataReply`` on the data plane) or an error."""

    proof: bytes


class Welcome(Msg):
    protocol_version: int
    server_id: str
    host_id: str
    roles: tuple[str, ...] = ()


# --------------------------------------------------------------------------- generic replies


class Ack(Msg):
    pass


class ErrorReply(Msg):
    code: str
    message: str
    retryable: bool = False


# --------------------------------------------------------------------------- data plane (transport.tcp)


class DataHello(Request["DataReply"]):
    """Opens a data-plane connection, as ``Hello`` does a control connection."""

    protocol_version: int
    role: str = ""
    nonce: bytes = b""
    peer_id: str = ""


class DataRequest(Request["DataReply"]):
    """Send bytes ``[offset, offset + length)`` of a tensor (after applying ``slices``, if any), in chunks
    each preceded by its 8-byte xxh3-64 checksum."""
    idempotent: ClassVar[bool] = True

    artifact_id: str
    name: str
    offset: int = 0
    length: int = -1
    slices: tuple[SliceSpec, ...] = ()
    chunk_bytes: int = 4 * 1024 * 1024
    tier: str = ""  # "" = any tier this worker holds


class DataReply(Msg):
    total: int  # bytes that follow (the requested range)
    chunk_bytes: int
    tier: str = "memory"
