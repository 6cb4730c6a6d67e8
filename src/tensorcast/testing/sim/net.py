"""The simulated network: processes by address, requests delivered to their handlers in one event loop.

Owns: ``SimNetwork`` (the processes, and what the scheduler decides about each message: its latency, whether
it is dropped, a partition between two processes, a paused or killed receiver) and ``SimCaller``, a
``wire.caller.Caller`` that delivers through it instead of sockets — the message encoded and decoded as on the
wire, the payload landing where the receiver's sink puts it, the reply's payload where the caller's sink
says, every outcome a typed error as over TCP: a killed peer refuses at once (``Unavailable``), a partition
or a dropped message holds the call until its deadline (``DeadlineExceeded``), a paused peer answers once it
resumes. ``observe`` is called with every delivered request and its outcome (the invariant checker). Every
task is counted to the process it was started for (``task_factory``), so that a kill stops all of them. The
data plane: ``SimDataPlane``, the in-process transport (``transport.inproc``) with this network's say over
who can reach whom (a worker that is dead, paused or cut off from the fetching process refuses at once).
Does not own: the processes (``sim.cluster``) or the decisions (``sim.scenario``).
"""

from __future__ import annotations

import asyncio
import contextvars
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from tensorcast.config import WireConfig
from tensorcast.context import CallContext
from tensorcast.errors import DeadlineExceeded, InternalError, TensorCastError, Unavailable
from tensorcast.transport.base import DataServer, FetchStats, SourceOpener
from tensorcast.transport.inproc import InProcTransport
from tensorcast.wire.caller import Caller
from tensorcast.wire.connection import ConnectionLost, Landing, NotSent, payload_views
from tensorcast.wire.messages import PROTOCOL_VERSION, DataRequest, Welcome
from tensorcast.wire.messages import Request as Call
from tensorcast.wire.protocol import Message
from tensorcast.wire.rpc import HandlerRegistry, Reply, Request

__all__ = ["PROCESS", "Delivery", "SimCaller", "SimDataPlane", "SimNetwork", "SimProcess"]

# The simulated process a task runs for (its log records say which); set for its loops and its handlers.
PROCESS: contextvars.ContextVar[str] = contextvars.ContextVar("sim_process", default="-")

R = TypeVar("R")
_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(Message)
_LONGEST = 60.0  # a call with no deadline waits at most this long for a partitioned or paused peer


@dataclass
class SimProcess:
    """One simulated process: its handlers, and whether it runs."""

    address: str
    registry: HandlerRegistry
    alive: bool = True
    resumed: asyncio.Event = field(default_factory=asyncio.Event)  # set while not paused
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)  # its handlers running now

    def __post_init__(self) -> None:
        self.resumed.set()

    @property
    def paused(self) -> bool:
        return not self.resumed.is_set()


@dataclass(frozen=True)
class Delivery:
    """A request that reached its receiver's handler, and how it ended (for the checker)."""

    src: str
    dst: str
    message: Any
    reply: Any  # the reply message, or the TensorCastError it raised
    at: float  # virtual monotonic time the handler finished


class _SimConn:
    """What a sink sees of the connection (a budget-free scratch buffer)."""

    def scratch(self, nbytes: int) -> tuple[memoryview, Callable[[], None]]:
        return memoryview(bytearray(nbytes)), lambda: None


class SimNetwork:
    def __init__(self, rng: random.Random, *, latency: tuple[float, float] = (0.0002, 0.002),
                 drop: float = 0.0) -> None:
        self.rng = rng
        self.latency = latency
        self.drop = drop
        self.processes: dict[str, SimProcess] = {}
        self._cut: set[frozenset[str]] = set()
        self.observe: Callable[[Delivery], None] = lambda d: None
        self.delivered = 0
        self.data_owner: dict[str, str] = {}  # data-plane address -> the process serving it

    def task_factory(self, loop: asyncio.AbstractEventLoop, coro: Any,
                     context: contextvars.Context | None = None) -> asyncio.Task[Any]:
        """The loop's task factory: each task is one of the process it runs for (``PROCESS``), which a kill
        cancels with the rest."""
        task: asyncio.Task[Any] = asyncio.Task(coro, loop=loop, context=context)
        proc = self.processes.get(context.get(PROCESS, "-") if context is not None else PROCESS.get())
        if proc is not None and proc.alive:
            proc.tasks.add(task)
            task.add_done_callback(proc.tasks.discard)
        return task

    def reachable(self, src: str, dst: str) -> bool:
        """Whether ``dst`` runs, and ``src`` and it can talk now."""
        proc, sender = self.processes.get(dst), self.processes.get(src)
        return proc is not None and proc.alive and not proc.paused and not (sender is not None and sender.paused) \
            and not self.cut(src, dst)

    def add(self, address: str, registry: HandlerRegistry) -> SimProcess:
        proc = SimProcess(address, registry)
        self.processes[address] = proc
        return proc

    def partition(self, a: str, b: str) -> None:
        self._cut.add(frozenset((a, b)))

    def heal(self, a: str | None = None, b: str | None = None) -> None:
        self._cut = set() if a is None else {c for c in self._cut if c != frozenset((a, b))}

    def cut(self, a: str, b: str) -> bool:
        return frozenset((a, b)) in self._cut

    async def _hold(self, ctx: CallContext, what: str) -> None:
        """A message that never arrives: the call waits out its deadline."""
        left = ctx.remaining()
        await asyncio.sleep(_LONGEST if left is None else max(0.0, min(left, _LONGEST)))
        raise DeadlineExceeded(f"{what}: no answer (partitioned or lost)", trace_id=ctx.trace_id)

    async def deliver(self, src: str, dst: str, msg: Any, ctx: CallContext, payload: Any, sink: Any) -> Any:
        what = type(msg).__name__
        sender = self.processes.get(src)
        if sender is not None and sender.paused:  # a stopped process sends nothing until it resumes
            await sender.resumed.wait()
        proc = self.processes.get(dst)
        if proc is None or not proc.alive:
            raise NotSent(f"cannot connect to {dst}: connection refused")
        await asyncio.sleep(self.rng.uniform(*self.latency))
        if self.cut(src, dst) or self.rng.random() < self.drop:
            await self._hold(ctx, what)
        if proc.paused:  # a stopped process answers once it runs again, or the call waits out its deadline
            try:
                await asyncio.wait_for(proc.resumed.wait(), max(0.0, ctx.remaining() or _LONGEST))
            except TimeoutError:
                raise DeadlineExceeded(f"{what}: no answer ({dst} is not running)", trace_id=ctx.trace_id) from None
        if not proc.alive:
            raise ConnectionLost(f"connection to {dst} lost")
        decoded = _DEC.decode(_ENC.encode(msg))  # what the wire carries, and nothing shared
        context = contextvars.copy_context()
        context.run(PROCESS.set, dst)
        task = asyncio.get_running_loop().create_task(self._handle(proc, decoded, ctx, payload), context=context)
        proc.tasks.add(task)
        task.add_done_callback(proc.tasks.discard)
        try:
            reply = await task
        except asyncio.CancelledError:
            if task.cancelled() and not proc.alive:
                raise ConnectionLost(f"connection to {dst} lost") from None
            raise
        except TensorCastError as exc:
            self.observe(Delivery(src, dst, decoded, exc, asyncio.get_running_loop().time()))
            await asyncio.sleep(self.rng.uniform(*self.latency))
            raise
        self.delivered += 1
        self.observe(Delivery(src, dst, decoded, reply.message, asyncio.get_running_loop().time()))
        try:
            if self.cut(src, dst) or self.rng.random() < self.drop:  # the reply is lost: the sender cannot tell
                await self._hold(ctx, what)
            await asyncio.sleep(self.rng.uniform(*self.latency))
            if reply.payload is not None and sink is not None:
                _copy(reply.payload, sink(reply.message) if callable(sink) else sink)
            return _DEC.decode(_ENC.encode(reply.message))
        finally:
            if reply.on_sent is not None:
                reply.on_sent()

    async def _handle(self, proc: SimProcess, msg: Any, ctx: CallContext, payload: Any) -> Reply:
        entry = proc.registry.get(type(msg))
        if entry is None:
            raise InternalError(f"{type(msg).__name__} is not served at {proc.address}")
        handler, sink_fn = entry
        landing: Landing | None = None
        views: Any = None
        if payload is not None:
            chosen = sink_fn(msg, _SimConn()) if sink_fn is not None else None  # type: ignore[arg-type]
            landing = chosen if isinstance(chosen, Landing) else None
            views = chosen.views if isinstance(chosen, Landing) else chosen
            if views is None:
                views = memoryview(bytearray(sum(v.nbytes for v in payload_views(payload))))
            try:
                _copy(payload, views)
            except BaseException:
                if landing is not None and landing.discard is not None:
                    landing.discard()
                raise
        try:
            result = await handler(msg, Request(None, ctx, views, None, landing.context if landing else None))
        except TensorCastError:
            if landing is not None and landing.discard is not None:
                landing.discard()
            raise
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if landing is not None and landing.discard is not None:
                landing.discard()
            raise InternalError(f"{type(exc).__name__}: {exc}") from exc
        return result if isinstance(result, Reply) else Reply(result)


def _copy(src: Any, dst: Any) -> None:
    """Bytes of payload ``src`` into the views of ``dst``, in order (sizes must match, as on the wire)."""
    data = b"".join(bytes(v) for v in payload_views(src))
    out = payload_views(dst)
    if sum(v.nbytes for v in out) != len(data):
        raise InternalError(f"payload of {len(data)} bytes for a {sum(v.nbytes for v in out)}-byte destination")
    pos = 0
    for v in out:
        v[:] = data[pos : pos + v.nbytes]
        pos += v.nbytes


class SimCaller(Caller):
    """A ``Caller`` of process ``owner`` whose requests cross the simulated network."""

    def __init__(self, net: SimNetwork, owner: str, address: str | list[str] = "",
                 timeout: float | None = None) -> None:
        super().__init__(WireConfig(), token=None, peer_id=owner, host_id=owner, address=address, timeout=timeout)
        self.net = net
        self.owner = owner

    async def call(self, msg: Call[R], ctx: CallContext | None = None, *, address: str | None = None,
                   payload: Any = None, sink: Any = None) -> R:
        ctx = ctx or self.context()
        expect = type(msg).reply_type()
        targets = [address] if address is not None else [self.address, *(a for a in self.defaults
                                                                         if a != self.address)]
        last: Exception | None = None
        for target in targets:
            try:
                reply = await self.net.deliver(self.owner, target, msg, ctx, payload, sink)
            except NotSent as exc:  # another default peer may answer (a client's gateways, the global stores)
                last = exc
                continue
            if not isinstance(reply, expect):
                raise InternalError(f"{target} answered {type(msg).__name__} with {type(reply).__name__}")
            if address is None:
                self.address = target
            return reply  # type: ignore[no-any-return]
        assert last is not None
        raise last

    async def connect(self, address: str | None = None) -> Any:
        """The peer's handshake: every simulated process is a host of its own."""
        target = address or self.address
        proc = self.net.processes.get(target)
        if proc is None or not proc.alive:
            raise NotSent(f"cannot connect to {target}: connection refused")
        return Welcome(protocol_version=PROTOCOL_VERSION, server_id=target, host_id=target)

    async def drop(self, address: str) -> None:
        return None

    async def close(self) -> None:
        return None


class SimDataPlane:
    """The data plane as process ``owner`` sees it: the in-process transport, whose fetches fail at once
    (``Unavailable``) from a worker that is dead, paused or cut off from ``owner`` (a real fetch would wait out
    its deadline first: the same outcome, sooner)."""

    kind = "inproc"

    def __init__(self, net: SimNetwork, owner: str) -> None:
        self.net = net
        self.owner = owner
        self._inner = InProcTransport()

    def fetch(self, address: str, request: DataRequest, dest: memoryview, *, streams: int = 1,
              deadline: float | None = None, trace_id: str = "", checksums: list[int] | None = None) -> FetchStats:
        dst = self.net.data_owner.get(address, "")
        if not self.net.reachable(self.owner, dst):
            raise Unavailable(f"data plane: {dst or address} cannot be reached from {self.owner}")
        return self._inner.fetch(address, request, dest, streams=streams, deadline=deadline, trace_id=trace_id,
                                 checksums=checksums)

    def serve(self, open_source: SourceOpener, *, corrupt_chunks: int = 0) -> DataServer:
        return self._inner.serve(open_source, corrupt_chunks=corrupt_chunks)

    def close(self) -> None:
        return None
