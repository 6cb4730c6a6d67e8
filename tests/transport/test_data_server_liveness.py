"""The data plane's own liveness: the TCP data server says whether its loop runs, and a worker whose data
plane stopped does not heartbeat (the cluster takes it for dead instead of sending readers to it)."""

from __future__ import annotations

import asyncio
from typing import Any

from tensorcast.config import WireConfig
from tensorcast.transport.base import SourceLease
from tensorcast.transport.tcp_server import TcpDataServer
from tensorcast.wire.messages import DataRequest, Heartbeat, HeartbeatReply
from tensorcast.worker.gs_link import GlobalStoreLink


def test_the_data_server_reports_whether_its_loop_runs() -> None:
    def source(req: DataRequest) -> SourceLease:
        return SourceLease(memoryview(b"x"), "memory", lambda: None)

    server = TcpDataServer(source, WireConfig(), token=None)
    assert not server.healthy()  # not started
    server.start("127.0.0.1", 0)
    assert server.healthy()
    server.close()
    assert not server.healthy()


class _Caller:
    def __init__(self) -> None:
        self.beats = 0

    async def call(self, msg: Any, ctx: Any = None, **kw: Any) -> Any:
        assert isinstance(msg, Heartbeat)
        self.beats += 1
        return HeartbeatReply(drop=(), reregister=False)


def test_no_heartbeat_while_the_worker_names_a_problem() -> None:
    async def run(problem: str) -> int:
        caller = _Caller()
        link = GlobalStoreLink(caller, "w0", heartbeat_interval=0.01)  # type: ignore[arg-type]

        async def reregister() -> None:
            return None

        stats = {"memory_used": 0, "memory_capacity": 1, "artifacts": 0}
        task = asyncio.ensure_future(link.heartbeat_loop(lambda: stats, lambda aid: None, reregister,
                                                         lambda: problem))
        await asyncio.sleep(0.2)
        task.cancel()
        return caller.beats

    assert asyncio.run(run("")) > 3
    assert asyncio.run(run("the data-plane server stopped serving")) == 0
