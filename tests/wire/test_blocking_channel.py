"""The blocking channel (a call on the caller's own thread) against a real RPC server, and against hostile ones:
the same handshake and proofs as the event-loop channel, typed errors as the server raised them, deadlines that
end a call and leave the next one working, and servers that close, stall or send frames it must not take
(a body of a gigabyte before authentication, a payload) answered with a typed error and nothing allocated."""

from __future__ import annotations

import asyncio
import errno
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tensorcast.client.loop import LoopThread
from tensorcast.config import WireConfig
from tensorcast.context import CallContext
from tensorcast.credentials import Keyring
from tensorcast.errors import DeadlineExceeded, InternalError, NotFound, TensorCastError, Unauthenticated
from tensorcast.wire.blocking import BlockingChannel, _out_of_time
from tensorcast.wire.cluster_messages import ListUnderReplicated, ListWorkers, WorkerList
from tensorcast.wire.frame_parts import ConnectionLost, NotSent, encode_envelope
from tensorcast.wire.frames import pack_header
from tensorcast.wire.messages import PROTOCOL_VERSION, GetArtifact, Welcome
from tensorcast.wire.protocol import ERROR, RESPONSE
from tensorcast.wire.rpc import HandlerRegistry, Request, RpcServer
from tensorcast.wire.shared import ReceiveBudget

SECRET = "blocking-channel-secret"


def ctx(seconds: float = 5.0) -> CallContext:
    return CallContext(deadline=time.time() + seconds)


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    lt = LoopThread("test-server")
    yield lt
    lt.stop()


def serve(loop: LoopThread, token: str | None, *, slow: float = 0.0) -> tuple[str, RpcServer]:
    registry = HandlerRegistry()
    calls = {"n": 0}

    async def workers(msg: ListWorkers, req: Request) -> WorkerList:
        calls["n"] += 1
        if slow:
            await asyncio.sleep(slow)
        return WorkerList(workers=())

    async def missing(msg: GetArtifact, req: Request) -> Any:
        raise NotFound(f"no artifact {msg.key_or_id!r}")

    async def wrong(msg: ListUnderReplicated, req: Request) -> Any:
        return WorkerList(workers=())  # not the UnderReplicated the request declares

    registry.register(ListWorkers, workers)
    registry.register(GetArtifact, missing)
    registry.register(ListUnderReplicated, wrong)
    server = RpcServer(registry, WireConfig(), token=token, server_id="s", host_id="h")

    async def start() -> str:
        return await server.start("127.0.0.1", 0)

    return loop.run(start()), server


def test_calls_with_a_credential_and_typed_errors_as_the_server_raised_them(loop: LoopThread) -> None:
    address, server = serve(loop, SECRET)
    client = Keyring.from_token(SECRET)
    assert client is not None
    ch = BlockingChannel(address, WireConfig(), token=client.credential("client"), peer_id="t")
    try:
        for _ in range(3):  # one connection, many calls
            assert isinstance(ch.call(ListWorkers(), ctx()), WorkerList)
        assert ch.welcome is not None and ch.welcome.server_id == "s"
        with pytest.raises(NotFound, match="no artifact 'x'"):
            ch.call(GetArtifact(key_or_id="x"), ctx())
        with pytest.raises(InternalError, match="expected UnderReplicated"):
            ch.call(ListUnderReplicated(), ctx())
        assert isinstance(ch.call(ListWorkers(), ctx()), WorkerList)  # the connection serves on
    finally:
        ch.close()
        loop.run(server.close())


def test_a_server_of_another_cluster_or_no_credential_is_refused(loop: LoopThread) -> None:
    address, server = serve(loop, SECRET)
    try:
        other = BlockingChannel(address, WireConfig(), token="another-secret")
        with pytest.raises(Unauthenticated, match="could not prove"):
            other.call(ListWorkers(), ctx())
        assert not other.connected
        none = BlockingChannel(address, WireConfig(), token=None)
        with pytest.raises(Unauthenticated, match="needs a credential"):
            none.call(ListWorkers(), ctx())
        assert not none.connected
    finally:
        loop.run(server.close())


def test_a_deadline_ends_the_call_and_the_next_one_works(loop: LoopThread) -> None:
    address, server = serve(loop, None, slow=30.0)
    ch = BlockingChannel(address, WireConfig(), token=None)
    try:
        with pytest.raises(NotFound):
            ch.call(GetArtifact(key_or_id="x"), ctx())  # connected
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            ch.call(ListWorkers(), ctx(0.3))  # its handler takes 30 s
        assert time.monotonic() - t0 < 10  # ended by its deadline, not by the server's reply
        assert not ch.connected  # a reply may still come on it: that connection is not reused
        with pytest.raises(NotFound):
            ch.call(GetArtifact(key_or_id="x"), ctx())
        with pytest.raises(DeadlineExceeded):
            ch.call(GetArtifact(key_or_id="x"), CallContext(deadline=time.time() - 1))
    finally:
        ch.close()
        loop.run(server.close())


def test_a_server_that_is_gone_or_restarts_says_not_sent_or_lost(loop: LoopThread) -> None:
    address, server = serve(loop, None)
    ch = BlockingChannel(address, WireConfig(), token=None)
    ch.call(ListWorkers(), ctx())
    loop.run(server.close())
    with pytest.raises((NotSent, ConnectionLost)):  # the old connection: closed by the server
        ch.call(ListWorkers(), ctx())
    with pytest.raises(NotSent):  # nobody listens there any more
        ch.call(ListWorkers(), ctx())


class _Hostile:
    """A server that answers each frame a connection sends with the next of ``replies`` (raw bytes; an empty
    one closes the connection), and stays silent once they run out."""

    def __init__(self, *replies: bytes) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.replies = replies
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            for reply in self.replies:
                try:
                    conn.recv(65536)
                    if not reply:
                        conn.close()
                        break
                    conn.sendall(reply)
                except OSError:
                    break

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def _frame(message: Any, request_id: int = 1, payload: bytes = b"") -> bytes:
    body = encode_envelope(request_id, RESPONSE, "", None, message)
    return pack_header(len(body), len(payload)) + body + payload


@pytest.mark.parametrize(("reply", "error", "why"), [
    (b"", NotSent, r"no handshake with .* closed the connection"),
    (pack_header(1 << 30, 0), InternalError, "exceeds the limit"),  # a 1 GiB body before authentication
    (b"GET / HTTP/1.1\r\n\r\n" * 4, InternalError, "bad magic"),
    (_frame(WorkerList(workers=()), payload=b"x" * 64), InternalError, "a payload"),
])
def test_hostile_servers_get_a_typed_error_and_no_memory(reply: bytes, error: type[TensorCastError],
                                                        why: str) -> None:
    hostile = _Hostile(reply)
    ch = BlockingChannel(hostile.address, WireConfig(), token=None)
    try:
        with pytest.raises(error, match=why):
            ch.call(ListWorkers(), ctx())
        assert not ch.connected
        assert ch._budget.held == 0  # nothing held for what the server announced
    finally:
        hostile.close()


def test_a_server_that_never_answers_the_handshake_is_given_up_on_in_time() -> None:
    hostile = _Hostile(b"TC")  # half a header, then silence
    ch = BlockingChannel(hostile.address, WireConfig(handshake_timeout=0.3), token=None)
    try:
        t0 = time.monotonic()
        with pytest.raises(NotSent, match=r"no handshake with .* deadline exceeded"):
            ch.call(ListWorkers(), ctx())
        assert time.monotonic() - t0 < 3
    finally:
        hostile.close()


def test_after_the_handshake_a_payload_or_a_stalled_reply_ends_only_that_connection() -> None:
    welcome = _frame(Welcome(protocol_version=PROTOCOL_VERSION, server_id="h", host_id="h"))
    cases = [(_frame(WorkerList(workers=()), request_id=2, payload=b"x" * 64), InternalError, 10.0),
             (pack_header(100, 0) + b"\x00" * 10, DeadlineExceeded, 3.0),
             (pack_header(1 << 20, 0) + b"\x00" * 1000, DeadlineExceeded, 3.0)]  # a large body, cut short
    for second, error, seconds in cases:
        hostile = _Hostile(welcome, second)
        budget = ReceiveBudget(1 << 30)
        ch = BlockingChannel(hostile.address, WireConfig(), token=None, budget=budget)
        try:
            t0 = time.monotonic()
            with pytest.raises(error):
                ch.call(ListWorkers(), ctx(seconds))
            assert time.monotonic() - t0 < seconds + 5
            assert not ch.connected and budget.held == 0  # what the reader held for the body is given back
        finally:
            hostile.close()


@pytest.mark.parametrize("request_id", [1, 0])
@pytest.mark.parametrize("token", [None, SECRET])
def test_an_error_frame_never_completes_the_handshake_whatever_it_carries(token: str | None,
                                                                         request_id: int) -> None:
    """An impostor answering ``Hello`` with an error frame whose body is a ``Welcome`` is not let in."""
    body = encode_envelope(request_id, ERROR, "", None,
                           Welcome(protocol_version=PROTOCOL_VERSION, server_id="x", host_id="x"))
    hostile = _Hostile(pack_header(len(body), 0) + body)
    ch = BlockingChannel(hostile.address, WireConfig(), token=token)
    try:
        with pytest.raises(InternalError, match="malformed error"):
            ch.call(ListWorkers(), ctx())
        assert not ch.connected and ch.welcome is None
    finally:
        hostile.close()


def test_the_kernel_giving_up_on_a_peer_is_a_lost_connection_not_a_deadline() -> None:
    assert _out_of_time(TimeoutError("timed out"))  # the socket's own timeout: the call's deadline
    assert not _out_of_time(TimeoutError(errno.ETIMEDOUT, "Connection timed out"))  # keepalive, TCP_USER_TIMEOUT
    assert not _out_of_time(ConnectionResetError(errno.ECONNRESET, "reset"))


def test_abort_from_another_thread_ends_a_call_in_flight_and_any_later_one(loop: LoopThread) -> None:
    address, server = serve(loop, None, slow=30.0)
    ch = BlockingChannel(address, WireConfig(), token=None)
    got: list[BaseException] = []

    def slow_call() -> None:
        try:
            ch.call(ListWorkers(), ctx(60))
        except BaseException as exc:
            got.append(exc)

    try:
        with pytest.raises(NotFound):
            ch.call(GetArtifact(key_or_id="x"), ctx())  # connected
        t = threading.Thread(target=slow_call)
        t.start()
        deadline = time.monotonic() + 10
        while not ch._busy.locked() and time.monotonic() < deadline:  # the call is under way
            time.sleep(0.01)
        time.sleep(0.2)  # (and waiting for its reply, most likely; sending it is all that could come first)
        ch.abort()
        t.join(10)
        assert not t.is_alive() and len(got) == 1 and isinstance(got[0], ConnectionLost), got
        assert not ch.connected
        with pytest.raises(NotSent, match="closed with its client"):
            ch.call(GetArtifact(key_or_id="x"), ctx())
        assert not ch.connected
    finally:
        ch.close()
        loop.run(server.close())


def test_receive_buffers_full_is_a_lost_connection_the_loop_can_retry() -> None:
    """The process's receive budget taken by other connections is not the server's fault: the call is
    ``ConnectionLost`` (the synchronous client sends it through its loop), not an error of the reply."""
    welcome = _frame(Welcome(protocol_version=PROTOCOL_VERSION, server_id="h", host_id="h"))
    hostile = _Hostile(welcome, pack_header(1 << 20, 0) + b"\x00" * (1 << 20))
    budget = ReceiveBudget(1 << 30)
    budget.take((1 << 30) - (1 << 19))  # held by the other connections of this process
    ch = BlockingChannel(hostile.address, WireConfig(), token=None, budget=budget)
    try:
        with pytest.raises(ConnectionLost, match="receive buffers full"):
            ch.call(ListWorkers(), ctx())
        assert not ch.connected and budget.held == (1 << 30) - (1 << 19)
    finally:
        hostile.close()
