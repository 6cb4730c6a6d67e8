"""Protocol robustness against a real worker: bad tokens, garbage, oversized and unknown frames."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

import tensorcast as tc
from tensorcast.cluster import LocalCluster
from tensorcast.errors import Unauthenticated
from tensorcast.testing import RawPeer, running_cluster
from tensorcast.wire.frames import pack_header
from tensorcast.wire.messages import ErrorReply, ListWorkers, Welcome, WorkerList
from tensorcast.wire.protocol import ERROR, RESPONSE

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def secured() -> Iterator[LocalCluster]:
    with running_cluster(workers=1, token=TOKEN, config={"wire.max_frame_bytes": 1 << 20}) as cluster:
        yield cluster


def _still_serving(cluster: LocalCluster) -> None:
    with tc.connect(cluster.address, token=TOKEN) as c:
        art = c.put(np.arange(4))
        assert np.array_equal(c.artifact(art.id).tensor(like="numpy"), np.arange(4))
        c.delete(art.id)


def test_wrong_or_missing_token_is_refused(secured: LocalCluster) -> None:
    with pytest.raises(Unauthenticated):
        tc.connect(secured.address, token="wrong")
    with pytest.raises(Unauthenticated):
        tc.connect(secured.address)
    peer = RawPeer(secured.address)
    env, msg = peer.hello(token="nope")
    assert env.kind == ERROR and isinstance(msg, ErrorReply) and msg.code == "UNAUTHENTICATED"
    assert peer.closed_by_peer()
    _still_serving(secured)


def test_request_before_handshake_is_refused(secured: LocalCluster) -> None:
    peer = RawPeer(secured.address)
    peer.send(ListWorkers())
    env, msg = peer.recv()
    assert env.kind == ERROR and msg.code == "UNAUTHENTICATED"
    assert peer.closed_by_peer()


def test_malformed_frame_gets_error_and_close(secured: LocalCluster) -> None:
    peer = RawPeer(secured.address)
    peer.send_raw(b"GARBAGE!" * 4)
    env, msg = peer.recv()
    assert env.kind == ERROR and msg.code == "INVALID_ARGUMENT" and "magic" in msg.message
    assert peer.closed_by_peer()
    # A well-framed body that is not msgpack.
    peer = RawPeer(secured.address)
    peer.hello(TOKEN)
    peer.send_raw(pack_header(5, 0) + b"\xc1\xc1\xc1\xc1\xc1")
    env, msg = peer.recv()
    assert env.kind == ERROR and msg.code == "INVALID_ARGUMENT"
    _still_serving(secured)


def test_oversized_frame_is_refused(secured: LocalCluster) -> None:
    peer = RawPeer(secured.address)
    peer.hello(TOKEN)
    peer.send_raw(pack_header(64 << 20, 0))  # claims a 64 MiB body; the limit is 1 MiB
    env, msg = peer.recv()
    assert env.kind == ERROR and msg.code == "RESOURCE_EXHAUSTED"
    assert peer.closed_by_peer()
    _still_serving(secured)


def test_unknown_message_type_gets_error_and_connection_survives(secured: LocalCluster) -> None:
    class Bogus(msgspec.Struct, tag=True):
        x: int

    peer = RawPeer(secured.address)
    env, welcome = peer.hello(TOKEN)
    assert env.kind == RESPONSE and isinstance(welcome, Welcome)
    peer.send(Bogus(x=1), request_id=7)
    env, msg = peer.recv()
    assert env.request_id == 7 and env.kind == ERROR and msg.code == "INVALID_ARGUMENT"
    peer.send(ListWorkers(), request_id=8)  # same connection still works
    env, msg = peer.recv()
    assert env.request_id == 8 and isinstance(msg, WorkerList)
    peer.close()


def test_unsolicited_payload_is_consumed_and_rejected(secured: LocalCluster) -> None:
    peer = RawPeer(secured.address)
    peer.hello(TOKEN)
    peer.send(ListWorkers(), request_id=3, payload=b"x" * 100_000)
    env, msg = peer.recv()
    assert env.request_id == 3 and env.kind == ERROR and msg.code == "INVALID_ARGUMENT"
    peer.send(ListWorkers(), request_id=4)
    env, msg = peer.recv()
    assert isinstance(msg, WorkerList)
    peer.close()


def test_each_request_declares_its_reply_once_and_the_tables_derive_from_it() -> None:
    from tensorcast.wire import kv_messages, messages
    from tensorcast.wire.protocol import IDEMPOTENT, MESSAGE_TYPES, REPLY_TO, REQUESTS

    assert REQUESTS and set(REPLY_TO) == set(REQUESTS)
    assert all(reply in MESSAGE_TYPES and not issubclass(reply, messages.Request) for reply in REPLY_TO.values())
    assert REPLY_TO[messages.GetArtifact] is messages.ArtifactReply  # a forward reference, resolved
    assert messages.GetArtifact in IDEMPOTENT and messages.PutBegin not in IDEMPOTENT
    assert messages.Request not in MESSAGE_TYPES and messages.Msg not in MESSAGE_TYPES
    # Every message any wire module defines is on the wire (its module is in the catalogue's MESSAGE_MODULES),
    # and the catalogue names every one but the KV-page ones (``wire.kv_messages``).
    import importlib
    import pkgutil

    import tensorcast.wire

    defined = {obj for info in pkgutil.iter_modules(tensorcast.wire.__path__)
               for name in [f"tensorcast.wire.{info.name}"]
               for obj in vars(importlib.import_module(name)).values()
               if isinstance(obj, type) and issubclass(obj, messages.Msg) and obj.__module__ == name}
    assert defined - {messages.Msg, messages.Request} == set(MESSAGE_TYPES)
    assert all(getattr(messages, t.__name__) is t for t in MESSAGE_TYPES if t.__module__ != kv_messages.__name__)

    class Undeclared(messages.Msg):
        pass

    class NoReply(messages.Request):  # type: ignore[type-arg]
        pass

    assert Undeclared not in MESSAGE_TYPES  # defined elsewhere: not on the wire
    with pytest.raises(TypeError, match="declares no reply type"):
        NoReply.reply_type()
