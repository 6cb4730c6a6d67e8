"""Both ends of a KV event stream over ZeroMQ, on vLLM's wire: ``EventPublisher`` and ``EventSubscriber``.

The publisher is what vLLM's ``ZmqEventPublisher`` is to a subscriber: a PUB socket sending multipart
messages ``(topic, sequence as 8 bytes big-endian, msgpack KVEventBatch)``, and, where a replay endpoint is
configured, a ROUTER socket answering a request for "every batch from sequence N" (an 8-byte big-endian
frame) with the buffered batches from N on, ended by a message whose sequence is -1. Sequence numbers start
at 0 when the publisher starts; a subscriber that sees a gap asks for a replay, and a publisher that started
again is told apart by its first batch, ``AllBlocksCleared``. Sends happen on the publisher's own thread:
``publish`` only queues (bounded: a batch beyond ``max_queue`` is dropped and counted, never blocking the
shard home). ``EventSubscriber`` (routers, tests) receives batches, asks for a replay of gaps, and decodes
with ``tensorcast.kv_events`` (or a decoder given: vLLM's own). Needs ``pyzmq`` (the ``events`` extra). Does
not own: what the events say (``tensorcast.kv_events``).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from tensorcast.credentials import is_loopback
from tensorcast.errors import InvalidArgument
from tensorcast.kv_events import KVEventBatch, decode_batch, encode_batch

__all__ = ["END_SEQ", "MAX_MESSAGE_BYTES", "EventPublisher", "EventSubscriber", "check_endpoint"]

log = logging.getLogger("tensorcast.kv")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
# The largest message a subscriber takes: a batch of thousands of blocks with their tokens is a few MiB. A
# publisher sending more is cut off before ZeroMQ buffers it, and ZeroMQ does not reconnect to it: its stream
# ends there (a router's memory is worth more than a broken publisher's events).
MAX_MESSAGE_BYTES = 64 << 20


def _zmq() -> Any:
    try:
        import zmq
    except ImportError:
        raise InvalidArgument("KV events need pyzmq: pip install 'tensorcast[events]'") from None
    return zmq


def check_endpoint(endpoint: str, allow_remote: bool, what: str = "kv.events_endpoint") -> None:
    """``InvalidArgument`` unless ``endpoint`` is ``tcp://HOST:PORT`` or ``ipc://PATH``, and, unless
    ``allow_remote``, only reachable from this host (the stream is unauthenticated)."""
    if endpoint.startswith("ipc://") and len(endpoint) > 6:
        return
    host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not endpoint.startswith("tcp://") or not sep or not port.isdigit() or not host:
        raise InvalidArgument(f"{what} {endpoint!r}: expected tcp://HOST:PORT or ipc://PATH")
    if not allow_remote and not is_loopback(host.strip("[]")):
        raise InvalidArgument(f"{what} {endpoint!r} is reachable from other hosts, and KV events are "
                              "unauthenticated: bind loopback, or set kv.events_allow_remote on a trusted network")


def _bind(sock: Any, endpoint: str) -> str:
    """Bind and return the endpoint bound (a ``tcp://HOST:0`` endpoint gets its port)."""
    try:
        sock.bind(endpoint)
    except Exception as exc:  # zmq.ZMQError: a bad or taken endpoint is the caller's configuration
        sock.close()
        raise InvalidArgument(f"cannot bind the KV event endpoint {endpoint!r}: {exc}") from None
    return str(sock.getsockopt_string(_zmq().LAST_ENDPOINT))


class EventPublisher:
    """Publish ``KVEventBatch``es on ``endpoint`` (bound, e.g. ``tcp://*:5557``) under ``topic``."""

    def __init__(self, endpoint: str, *, topic: str = "", replay_endpoint: str | None = None,
                 buffer_batches: int = 10_000, max_queue: int = 100_000) -> None:
        zmq = _zmq()
        self.topic = topic.encode()
        self.dropped = 0  # batches dropped because the queue was full
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = _bind(self._pub, endpoint)
        self._replay = None
        self.replay_endpoint: str | None = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            # A request is one 8-byte frame (and an identity): a peer sending more is cut off before
            # ZeroMQ buffers it, so an unauthenticated peer commits no memory here.
            self._replay.setsockopt(zmq.MAXMSGSIZE, 256)
            try:
                self.replay_endpoint = _bind(self._replay, replay_endpoint)
            except InvalidArgument:
                self._pub.close()
                raise
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="tensorcast-kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (for at most ``timeout`` seconds), then close the sockets."""
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout)
        self._thread.join(timeout)
        self._pub.close()
        if self._replay is not None:
            self._replay.close()

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = encode_batch(batch)
            seq = self._seq.to_bytes(8, "big")
            try:
                self._pub.send_multipart((self.topic, seq, payload))
            except Exception:
                log.exception("sending a KV event batch failed")
            self._buffer.append((self._seq, payload))
            self._seq += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:  # (identity, empty, start): anything else is ignored
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


class EventSubscriber:
    """Receive the batches of one publisher, in order, replaying gaps where it has a replay endpoint."""

    def __init__(self, endpoint: str, *, topic: str = "", replay_endpoint: str | None = None,
                 decoder: Callable[[bytes], Any] = decode_batch) -> None:
        zmq = _zmq()
        self._decoder = decoder  # vLLM's own msgspec decoder decodes these batches too
        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        try:
            self._sub.setsockopt(zmq.LINGER, 0)
            self._sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
            self._sub.connect(endpoint)
        except BaseException:  # an endpoint ZeroMQ refuses: the socket is not left behind
            self._sub.close()
            raise
        self._replay_endpoint = replay_endpoint
        self.next_seq: int | None = None  # the sequence expected next (None: nothing seen yet)
        self.gaps = 0  # batches missed and not replayed
        self.malformed = 0  # messages that were not a KVEventBatch (skipped)

    def close(self) -> None:
        self._sub.close()

    def replay(self, start: int, timeout: float) -> list[tuple[int, KVEventBatch]]:
        """Ask the publisher for every batch from ``start`` on (empty without a replay endpoint)."""
        if self._replay_endpoint is None:
            return []
        sock = self._ctx.socket(self._zmq.DEALER)
        sock.setsockopt(self._zmq.LINGER, 0)
        sock.setsockopt(self._zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.connect(self._replay_endpoint)
        out: list[tuple[int, KVEventBatch]] = []
        try:
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            while sock.poll(int(timeout * 1000)):
                _, _, seq_bytes, payload = sock.recv_multipart()
                if seq_bytes == END_SEQ:
                    break
                batch = self._decode(payload)
                if batch is not None:
                    out.append((int.from_bytes(seq_bytes, "big"), batch))
        finally:
            sock.close()
        return out

    def poll(self, timeout: float) -> Iterator[tuple[int, KVEventBatch]]:
        """Batches that arrive within ``timeout`` seconds of the first wait (at least those already here),
        with any gap before them replayed first."""
        wait = int(timeout * 1000)
        while self._sub.poll(wait):
            wait = 0
            frames = self._sub.recv_multipart()
            batch = self._decode(frames[2]) if len(frames) == 3 and len(frames[1]) == 8 else None
            if batch is None:
                self.malformed += len(frames) != 3 or len(frames[1]) != 8
                continue
            seq = int.from_bytes(frames[1], "big")
            if self.next_seq is not None and seq > self.next_seq:
                missed = [(s, b) for s, b in self.replay(self.next_seq, 1.0) if self.next_seq <= s < seq]
                self.gaps += seq - self.next_seq - len(missed)
                yield from missed
            elif self.next_seq is not None and seq < self.next_seq:
                restarted = bool(batch.events) and type(batch.events[0]).__name__ == "AllBlocksCleared"
                if not restarted:
                    continue  # seen already (a replay overlapping the live stream)
            self.next_seq = seq + 1
            yield seq, batch

    def _decode(self, payload: bytes) -> KVEventBatch | None:
        try:
            return self._decoder(payload)  # type: ignore[no-any-return]
        except msgspec.MsgspecError:
            self.malformed += 1
            return None
