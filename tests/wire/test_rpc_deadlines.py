"""A request's deadline ends its handler on the server, and trace ids stay unique across a fork."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from tensorcast.config import WireConfig
from tensorcast.context import CallContext, new_trace_id
from tensorcast.errors import DeadlineExceeded
from tensorcast.wire.channel import RpcChannel
from tensorcast.wire.cluster_messages import ListUnderReplicated, ListWorkers, UnderReplicated, WorkerList
from tensorcast.wire.rpc import HandlerRegistry, Request, RpcServer


async def _served(slow_cancelled: asyncio.Event) -> tuple[RpcServer, RpcChannel]:
    registry = HandlerRegistry()

    async def slow(msg: ListWorkers, req: Request) -> WorkerList:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            slow_cancelled.set()
            raise
        return WorkerList(workers=())

    async def fast(msg: ListUnderReplicated, req: Request) -> UnderReplicated:
        return UnderReplicated(artifacts=())

    registry.register(ListWorkers, slow)
    registry.register(ListUnderReplicated, fast)
    server = RpcServer(registry, WireConfig(), token=None, server_id="s", host_id="h")
    address = await server.start("127.0.0.1", 0)
    return server, RpcChannel(address, WireConfig(), token=None)


def test_deadline_cancels_the_handler_and_the_server_serves_on() -> None:
    async def main() -> None:
        cancelled = asyncio.Event()
        server, channel = await _served(cancelled)
        try:
            with pytest.raises(DeadlineExceeded):
                await channel.call(ListWorkers(), CallContext(deadline=time.time() + 0.2))
            # The server ends the handler by the same deadline, not when its 60 s sleep would end.
            await asyncio.wait_for(cancelled.wait(), 5)
            reply = await channel.call(ListUnderReplicated(), CallContext(deadline=time.time() + 5))
            assert isinstance(reply.message, UnderReplicated)
        finally:
            await channel.close()
            await server.close()

    asyncio.run(main())


def test_trace_ids_are_unique_and_a_forked_child_draws_its_own() -> None:
    ids = {new_trace_id() for _ in range(10_000)}
    assert len(ids) == 10_000 and all(len(i) == 16 and int(i, 16) >= 0 for i in ids)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its first ids, to the parent
        os.write(write, " ".join(new_trace_id() for _ in range(100)).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as f:
        child = set(f.read().split())
    parent = {new_trace_id() for _ in range(100)}
    assert len(child) == 100 and not child & parent and not child & ids
