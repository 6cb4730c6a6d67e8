"""Credentials: the cluster secret, the per-role credentials derived from it, and who may bind what.

Owns: the roles (``read-only`` < ``client`` < ``worker``; each may do what the weaker ones may), deriving a
role's credential from the cluster secret or from a stronger credential (HMAC-SHA256 down the chain secret ->
worker -> client -> read-only, so that a credential yields every weaker one and no stronger one), what
``TENSORCAST_TOKEN`` may hold (the secret, or a credential ``ROLE:HEX``), checking a credential presented
whole (an HTTP bearer), and the rule that nothing binds beyond loopback without a token. Does not own: the
handshake that proves a credential without sending it (``wire.handshake``), or which request needs which
role (``wire.protocol.REQUIRED_ROLE``).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import socket

from tensorcast.errors import InvalidArgument

__all__ = ["CLIENT", "READ_ONLY", "ROLES", "WORKER", "Keyring", "allows", "check_bind", "is_loopback"]

READ_ONLY, CLIENT, WORKER = "read-only", "client", "worker"
ROLES: tuple[str, ...] = (READ_ONLY, CLIENT, WORKER)  # weakest first
_RANK = {role: i for i, role in enumerate(ROLES)}
_LABEL = b"tensorcast credential v1 "
_CREDENTIAL = re.compile(r"(read-only|client|worker):([0-9a-f]{64})")


def allows(role: str, required: str) -> bool:
    """Whether a peer of ``role`` may send a request that needs ``required``."""
    return role in _RANK and _RANK[role] >= _RANK[required]


def _step(key: bytes, role: str) -> bytes:
    return hmac.new(key, _LABEL + role.encode(), hashlib.sha256).digest()


class Keyring:
    """What one process holds: the key of its strongest role (``role``), from which every weaker role's key
    follows. Built from the cluster secret (``secret``: then ``role`` is ``worker``) or from a credential."""

    __slots__ = ("key_of_role", "role", "secret")

    def __init__(self, role: str, key: bytes, *, secret: bool = False) -> None:
        self.role = role
        self.key_of_role = key
        self.secret = secret

    @classmethod
    def from_token(cls, token: str | None) -> Keyring | None:
        """None without a token; a credential ``ROLE:HEX`` is that role's; anything else is the cluster secret.
        A token that starts like a credential but is not one is refused (a credential cut short)."""
        if token is None:
            return None
        text = token.strip()
        if not text:
            raise InvalidArgument("the cluster token is empty or blank")
        m = _CREDENTIAL.fullmatch(text)
        if m is not None:
            return cls(m.group(1), bytes.fromhex(m.group(2)))
        role = text.partition(":")[0]
        if role in _RANK and ":" in text:
            raise InvalidArgument(f"a {role} credential is {role}: and 64 hex digits; this one is malformed "
                                  "(cut short?)")
        return cls(WORKER, _step(text.encode(), WORKER), secret=True)

    def can(self, role: str) -> bool:
        """Whether this keyring holds (or derives) ``role``'s key."""
        return role in _RANK and _RANK[role] <= _RANK[self.role]

    def key(self, role: str) -> bytes:
        """``role``'s key (``InvalidArgument`` for a role stronger than this keyring's)."""
        if not self.can(role):
            raise InvalidArgument(f"a {self.role} credential cannot make a {role!r} one (roles: {', '.join(ROLES)})")
        key = self.key_of_role
        for weaker in reversed(ROLES[_RANK[role] : _RANK[self.role]]):
            key = _step(key, weaker)
        return key

    def credential(self, role: str) -> str:
        """``role``'s credential, as ``TENSORCAST_TOKEN`` takes it."""
        return f"{role}:{self.key(role).hex()}"

    def verify_presented(self, text: str) -> str | None:
        """The role of ``text`` sent whole (a credential, or the secret), when this keyring can check it: compared
        (constant time) at the weaker of its role and this keyring's. None when it does not hold."""
        try:
            other = Keyring.from_token(text)
        except InvalidArgument:
            return None
        if other is None:
            return None
        level = ROLES[min(_RANK[other.role], _RANK[self.role])]
        return other.role if hmac.compare_digest(other.key(level), self.key(level)) else None


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` reaches this machine only ("" and 0.0.0.0 bind every interface)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


def check_bind(host: str, token: str | None, what: str) -> None:
    """Without a token, ``what`` may listen on loopback only: anyone who can reach a port could do anything."""
    if token is None and not is_loopback(host):
        raise InvalidArgument(f"refusing to serve {what} on {host or 'every interface'!r} without a cluster token: "
                              "set TENSORCAST_TOKEN, or bind loopback (127.0.0.1)")
