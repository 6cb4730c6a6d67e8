"""The handshake's and the credentials' pure decisions, table-driven: derivation down the role chain, what a
presented credential proves, the challenge-response on both sides (a replayed or foreign proof never holds),
every request type's required role, and which binds need a token."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from tensorcast.credentials import CLIENT, READ_ONLY, ROLES, WORKER, Keyring, allows, check_bind, is_loopback
from tensorcast.errors import InvalidArgument, Unauthenticated
from tensorcast.wire.handshake import ClientHandshake, ServerHandshake
from tensorcast.wire.messages import Challenge
from tensorcast.wire.protocol import HANDSHAKE, REPLY_TO, REQUIRED_ROLE, required_role

SECRET = "cluster-secret"


def counter_nonces(start: int = 1) -> Callable[[int], bytes]:
    """Nonces that differ from one draw to the next, predictably."""
    counter = itertools.count(start)
    return lambda n: next(counter).to_bytes(n, "big")


def test_the_secret_derives_every_role_and_a_credential_only_weaker_ones() -> None:
    root = Keyring.from_token(SECRET)
    assert root is not None and root.role == WORKER and root.secret
    for role in ROLES:
        cred = Keyring.from_token(root.credential(role))
        assert cred is not None and cred.role == role and not cred.secret
        for weaker in ROLES[: ROLES.index(role) + 1]:
            assert cred.key(weaker) == root.key(weaker)  # the same key down either path
        for stronger in ROLES[ROLES.index(role) + 1 :]:
            assert not cred.can(stronger)
            with pytest.raises(InvalidArgument):
                cred.key(stronger)
    assert len({root.key(r) for r in ROLES}) == len(ROLES)
    other = Keyring.from_token("another-secret")
    assert other is not None and all(other.key(r) != root.key(r) for r in ROLES)


@pytest.mark.parametrize("token", ["client:abc", "worker:" + "0" * 63, "read-only:" + "g" * 64])
def test_a_credential_cut_short_is_refused(token: str) -> None:
    with pytest.raises(InvalidArgument, match="malformed"):
        Keyring.from_token(token)


@pytest.mark.parametrize(("holder", "presented", "role"), [
    (WORKER, SECRET, WORKER),          # the secret, checked at the holder's level
    (READ_ONLY, SECRET, WORKER),
    (WORKER, CLIENT, CLIENT),
    (CLIENT, WORKER, WORKER),          # a stronger credential, checked by what it derives
    (READ_ONLY, READ_ONLY, READ_ONLY),
    (WORKER, "wrong-secret", None),
    (CLIENT, "other:" + "ab" * 32, None),
    (WORKER, "", None),
])
def test_what_a_credential_presented_whole_proves(holder: str, presented: str, role: str | None) -> None:
    root = Keyring.from_token(SECRET)
    assert root is not None
    server = Keyring.from_token(root.credential(holder))
    assert server is not None
    text = root.credential(presented) if presented in ROLES else presented
    assert server.verify_presented(text) == role


def _exchange(server: ServerHandshake, client: ClientHandshake) -> str:
    challenge = server.hello(client.role, client.nonce, client.peer_id)
    if challenge is None:
        client.accepted("srv")
        return server.role
    return server.answer(client.challenged(challenge, "srv"))


@pytest.mark.parametrize(("server_token", "client_role", "accepted"), [
    (SECRET, WORKER, WORKER),
    (SECRET, CLIENT, CLIENT),
    (SECRET, READ_ONLY, READ_ONLY),
    ("worker", CLIENT, CLIENT),   # a server holding the worker credential checks weaker ones too
    ("client", WORKER, None),     # ...but not stronger ones
    ("other-secret", CLIENT, None),
])
def test_the_challenge_response(server_token: str, client_role: str, accepted: str | None) -> None:
    root = Keyring.from_token(SECRET)
    assert root is not None
    server_keys = Keyring.from_token(root.credential(server_token) if server_token in ROLES else server_token)
    server = ServerHandshake(server_keys, "gs", "rpc", counter_nonces(100))
    client = ClientHandshake(Keyring.from_token(root.credential(client_role)), "c1", "rpc", counter_nonces(1))
    if accepted is None:
        with pytest.raises(Unauthenticated):
            _exchange(server, client)
    else:
        assert _exchange(server, client) == accepted


def test_a_recorded_proof_does_not_replay() -> None:
    keys = Keyring.from_token(SECRET)
    first = ServerHandshake(keys, "gs", "rpc", counter_nonces(100))
    client = ClientHandshake(keys, "c1", "rpc", counter_nonces(1))
    challenge = first.hello(client.role, client.nonce, client.peer_id)
    assert challenge is not None
    recorded = client.challenged(challenge, "gs")
    assert first.answer(recorded) == WORKER
    # The same Hello and Proof on a new connection: the server's nonce differs, so the proof does not hold.
    second = ServerHandshake(keys, "gs", "rpc", counter_nonces(200))
    assert second.hello(client.role, client.nonce, client.peer_id) is not None
    with pytest.raises(Unauthenticated, match="does not hold"):
        second.answer(recorded)
    # Nor on the other channel, nor for another peer id, nor at a server that says another id.
    for channel, peer, server_id in [("data", "c1", "gs"), ("rpc", "c2", "gs"), ("rpc", "c1", "w0")]:
        again = ServerHandshake(keys, server_id, channel, counter_nonces(100))  # even with the same nonce
        again.hello(client.role, client.nonce, peer)
        with pytest.raises(Unauthenticated):
            again.answer(recorded)
    # One try per challenge.
    third = ServerHandshake(keys, "gs", "rpc", counter_nonces(300))
    third.hello(client.role, client.nonce, client.peer_id)
    with pytest.raises(Unauthenticated):
        third.answer(b"x" * 32)
    with pytest.raises(Unauthenticated):
        third.answer(recorded)


def test_the_caller_checks_the_server_too() -> None:
    keys = Keyring.from_token(SECRET)
    client = ClientHandshake(keys, "c1", "rpc", counter_nonces(1))
    fake = ServerHandshake(Keyring.from_token("not-the-secret"), "gs", "rpc", counter_nonces(100))
    challenge = fake.hello(client.role, client.nonce, client.peer_id)
    assert challenge is not None
    with pytest.raises(Unauthenticated, match="could not prove"):
        client.challenged(challenge, "gs")
    # A server's own proof, sent back as if it were a challenge's nonce and proof: the sides differ.
    mirror = Challenge(nonce=client.nonce, server_id="gs", proof=challenge.proof)
    with pytest.raises(Unauthenticated):
        client.challenged(mirror, "gs")
    with pytest.raises(Unauthenticated, match="without checking"):
        client.accepted("gs")  # a server that lets a credential in unchecked is not one of this cluster


@pytest.mark.parametrize(("server_token", "role", "nonce", "why"), [
    (None, CLIENT, b"n" * 32, "without a token"),
    (SECRET, "", b"", "missing"),
    (SECRET, "admin", b"n" * 32, "cannot verify"),
    (SECRET, CLIENT, b"short", "nonce"),
    (SECRET, CLIENT, b"n" * 65, "nonce"),
])
def test_hellos_refused(server_token: str | None, role: str, nonce: bytes, why: str) -> None:
    server = ServerHandshake(Keyring.from_token(server_token), "gs", "rpc")
    with pytest.raises(Unauthenticated, match=why):
        server.hello(role, nonce, "c1")


def test_without_a_token_anyone_who_connects_is_a_worker() -> None:
    server = ServerHandshake(None, "gs", "rpc")
    assert server.hello("", b"", "c1") is None and server.role == WORKER
    with pytest.raises(Unauthenticated):
        server.answer(b"")  # no challenge was made


def test_every_request_type_has_a_required_role() -> None:
    requests = set(REPLY_TO) - HANDSHAKE
    assert requests <= set(REQUIRED_ROLE), sorted(t.__name__ for t in requests - set(REQUIRED_ROLE))
    assert set(REQUIRED_ROLE) <= requests
    assert set(REQUIRED_ROLE.values()) <= set(ROLES)
    assert required_role(object()) == WORKER  # anything unknown needs the strongest role


@pytest.mark.parametrize(("role", "required", "ok"), [
    (WORKER, WORKER, True), (WORKER, READ_ONLY, True), (CLIENT, WORKER, False), (CLIENT, CLIENT, True),
    (READ_ONLY, CLIENT, False), (READ_ONLY, READ_ONLY, True), ("", READ_ONLY, False), ("admin", READ_ONLY, False),
])
def test_allows(role: str, required: str, ok: bool) -> None:
    assert allows(role, required) is ok


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.3.4.5", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("0.0.0.0", False), ("", False), ("::", False), ("10.1.2.3", False), ("no-such-host.invalid", False),
])
def test_binds_that_need_a_token(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
    check_bind(host, "a-token", "x")  # with a token anything may be bound
    if loopback:
        check_bind(host, None, "x")
    else:
        with pytest.raises(InvalidArgument, match="without a cluster token"):
            check_bind(host, None, "x")
