"""The handshake's decisions: a challenge-response that proves a credential without sending it.

A caller opens with ``Hello{role, nonce}`` (``DataHello`` on the data plane). A server without a token accepts
a ``Hello`` without a role at once (and refuses one with a role: a misconfigured caller or cluster). A server
with a token answers ``Challenge{nonce, server_id, proof}``: its own fresh nonce and an HMAC, under the
role's key, over both nonces and the context (which side, which channel, the role, the server's and the
caller's ids) that proves the server holds the key too. The caller checks it and answers ``Proof``, the same
HMAC from its side. Neither proof is valid on another connection (each side's nonce is fresh), from the
other side, on the other channel or for another role, so a recorded handshake does not replay. Proofs are
compared in constant time.

Owns: ``ServerHandshake`` and ``ClientHandshake`` (one connection's state each, the nonces drawn by an
injectable function) and the proofs. Does not own: the frames and sockets (``wire.rpc``, ``wire.channel``,
``transport.tcp_server``, ``transport.tcp``), or the keys (``credentials``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable

from tensorcast.credentials import ROLES, WORKER, Keyring
from tensorcast.errors import Unauthenticated, clip
from tensorcast.wire.messages import Challenge

__all__ = ["NONCE_BYTES", "ClientHandshake", "ServerHandshake", "proof"]

NONCE_BYTES = 32
_MIN_NONCE, _MAX_NONCE = 16, 64
_CONTEXT = b"tensorcast handshake v6"
Nonces = Callable[[int], bytes]


def proof(key: bytes, side: str, channel: str, role: str, client_nonce: bytes, server_nonce: bytes,
          server_id: str, peer_id: str) -> bytes:
    """HMAC-SHA256 under ``key`` of the handshake's context, each field length-prefixed (no two contexts
    encode alike)."""
    fields = [_CONTEXT, side.encode(), channel.encode(), role.encode(), client_nonce, server_nonce,
              server_id.encode(), peer_id.encode()]
    return hmac.new(key, b"".join(len(f).to_bytes(4, "big") + f for f in fields), hashlib.sha256).digest()


class ServerHandshake:
    """One connection, server side: ``hello`` (a ``Challenge`` to send, or None: accepted), then ``answer``.
    ``role`` is the peer's once accepted: its credential's, or ``worker`` on a cluster without a token (where
    anyone who can connect may do anything)."""

    def __init__(self, keyring: Keyring | None, server_id: str, channel: str, nonces: Nonces = secrets.token_bytes):
        self.keyring = keyring
        self.server_id = server_id
        self.channel = channel
        self._nonces = nonces
        self.role = ""
        self._expected = b""  # the caller's proof, once challenged
        self._claimed = ""

    def hello(self, role: str, nonce: bytes, peer_id: str) -> Challenge | None:
        """A ``Hello``'s role and nonce: None when accepted at once, else the ``Challenge`` to send.
        ``Unauthenticated`` when refused."""
        if self._claimed or self.role:
            raise Unauthenticated("a second Hello on one connection")
        if self.keyring is None:
            if role:
                raise Unauthenticated("this cluster runs without a token, yet a credential was sent: configure the "
                                      "cluster with it (TENSORCAST_TOKEN) or connect without one")
            self.role = WORKER
            return None
        if not role:
            raise Unauthenticated("wrong or missing cluster token: this cluster needs a credential")
        if role not in ROLES or not self.keyring.can(role):
            raise Unauthenticated(f"this server cannot verify a {clip(role, 32)} credential")
        if not _MIN_NONCE <= len(nonce) <= _MAX_NONCE:
            raise Unauthenticated(f"a Hello's nonce must be {_MIN_NONCE} to {_MAX_NONCE} bytes")
        key = self.keyring.key(role)
        mine = self._nonces(NONCE_BYTES)
        self._claimed = role
        self._expected = proof(key, "client", self.channel, role, nonce, mine, self.server_id, peer_id)
        return Challenge(nonce=mine, server_id=self.server_id,
                         proof=proof(key, "server", self.channel, role, nonce, mine, self.server_id, peer_id))

    def answer(self, sent: bytes) -> str:
        """The caller's ``Proof``: its role when it holds; ``Unauthenticated`` otherwise (and for a proof that
        no challenge asked for)."""
        if not self._expected or self.role:
            raise Unauthenticated("a Proof without a challenge")
        expected, self._expected = self._expected, b""  # one try per challenge
        if not hmac.compare_digest(expected, sent):
            raise Unauthenticated("wrong or missing cluster token: the credential's proof does not hold")
        self.role = self._claimed
        return self.role


class ClientHandshake:
    """One connection, caller side: the ``role`` and ``nonce`` its ``Hello`` carries, then ``challenged`` (the
    proof to send) or ``accepted`` (a server that asked for none)."""

    def __init__(self, keyring: Keyring | None, peer_id: str, channel: str, nonces: Nonces = secrets.token_bytes):
        self.keyring = keyring
        self.peer_id = peer_id
        self.channel = channel
        self.role = keyring.role if keyring is not None else ""
        self.nonce = nonces(NONCE_BYTES) if keyring is not None else b""

    def challenged(self, challenge: Challenge, address: str) -> bytes:
        """The proof answering ``challenge``, once the server proved it holds the key too."""
        if self.keyring is None:
            raise Unauthenticated(f"{address} asks for a credential and none is configured (TENSORCAST_TOKEN)")
        if not _MIN_NONCE <= len(challenge.nonce) <= _MAX_NONCE:
            raise Unauthenticated(f"{address}: a challenge with a malformed nonce")
        key = self.keyring.key(self.role)
        args = (self.channel, self.role, self.nonce, challenge.nonce, challenge.server_id, self.peer_id)
        if not hmac.compare_digest(proof(key, "server", *args), challenge.proof):
            raise Unauthenticated(f"{address} could not prove it holds this cluster's credentials: another cluster, "
                                  "or not a TensorCast server of this cluster")
        return proof(key, "client", *args)

    def accepted(self, address: str) -> None:
        """The server let us in without a challenge: only right when neither side has a token."""
        if self.keyring is not None:
            raise Unauthenticated(f"{address} accepted the connection without checking the credential: it runs "
                                  "without a token, or is not a server of this cluster")
