"""A raw TCP peer that speaks (or deliberately mis-speaks) the frame protocol, for robustness tests."""

from __future__ import annotations

import secrets
import socket
from typing import Any

import msgspec

from tensorcast.checksums import chunk_checksums, pack_checksums
from tensorcast.credentials import Keyring
from tensorcast.wire.connection import encode_envelope
from tensorcast.wire.frames import CHECKSUMS, HEADER, pack_header
from tensorcast.wire.handshake import NONCE_BYTES, proof
from tensorcast.wire.messages import PROTOCOL_VERSION, Challenge, DataHello, Hello, Proof
from tensorcast.wire.protocol import REQUEST, Envelope, Message

__all__ = ["RawPeer"]

_ENV = msgspec.msgpack.Decoder(Envelope)
_MSG = msgspec.msgpack.Decoder(Message)


class RawPeer:
    def __init__(self, address: str, timeout: float = 5.0) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.sent: list[bytes] = []  # every frame ``send`` wrote

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send(self, message: Any, request_id: int = 1, payload: bytes = b"", trace_id: str = "raw",
             checksums: bool = True, deadline: float | None = None) -> None:
        """One request frame; a payload goes with its chunk checksums unless ``checksums=False`` (which a
        server must refuse)."""
        body = encode_envelope(request_id, REQUEST, trace_id, deadline, message)
        sums = pack_checksums(chunk_checksums(memoryview(payload))) if payload and checksums else b""
        flags = CHECKSUMS if sums else 0
        frame = pack_header(len(body), len(payload), flags) + body + sums + payload
        self.sent.append(frame)
        self.sock.sendall(frame)

    def hello(self, token: str | None = None, *, data: bool = False) -> tuple[Envelope, Any]:
        """The handshake with ``token`` (the secret or a credential): ``Hello`` (``DataHello`` with ``data``),
        and a ``Proof`` when the server challenges; returns the last reply (``Welcome``, ``DataReply`` or an
        error). The frames sent are kept in ``sent`` (to replay them)."""
        keyring = Keyring.from_token(token)
        channel = "data" if data else "rpc"
        role = keyring.role if keyring is not None else ""
        nonce = secrets.token_bytes(NONCE_BYTES) if keyring is not None else b""
        self.send(DataHello(protocol_version=PROTOCOL_VERSION, role=role, nonce=nonce, peer_id="raw") if data
                  else Hello(protocol_version=PROTOCOL_VERSION, role=role, nonce=nonce, peer_id="raw"))
        env, msg = self.recv()
        if isinstance(msg, Challenge) and keyring is not None:  # answered without checking the server's proof
            mine = proof(keyring.key(role), "client", channel, role, nonce, msg.nonce, msg.server_id, "raw")
            self.send(Proof(proof=mine), request_id=2)
            env, msg = self.recv()
        return env, msg

    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("peer closed the connection")
            buf += chunk
        return bytes(buf)

    def recv(self) -> tuple[Envelope, Any]:
        _magic, _ver, flags, body_len, payload_len = HEADER.unpack(self._recv_exact(HEADER.size))
        env = _ENV.decode(self._recv_exact(body_len))
        if payload_len:
            if flags & CHECKSUMS:
                self._recv_exact(8 * -(-payload_len // (4 << 20)))
            self._recv_exact(payload_len)
        return env, _MSG.decode(env.body)

    def closed_by_peer(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except (ConnectionResetError, TimeoutError):
            return True

    def close(self) -> None:
        self.sock.close()
