"""No token, loopback only — on every entry point: the global store and the worker (their commands and the
library functions), the metrics endpoint, the data plane and an instance runtime each refuse to listen beyond
loopback without a token, before anything starts (``tests/cli/test_up.py``: a token-less ``tensorcast up`` says
it is open to every local user)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from tensorcast.config import Config, WireConfig
from tensorcast.errors import InvalidArgument
from tensorcast.gs.service import run_global_store
from tensorcast.instance.runtime import InstanceRuntime
from tensorcast.obs.http import HttpServer
from tensorcast.transport.tcp_server import TcpDataServer
from tensorcast.wire.rpc import HandlerRegistry, RpcServer
from tensorcast.worker.server import run_worker

EVERYWHERE = "0.0.0.0"


def _tokenless(**flat: object) -> Config:
    # Nothing in the environment sets a token or a host (the suite's conftest sets weights.allowed_roots only).
    env = sorted(k for k in os.environ if k.startswith("TENSORCAST_") and k != "TENSORCAST_WEIGHTS_ALLOWED_ROOTS")
    assert msgspec.structs.replace(Config.load(), weights=Config().weights) == Config(), \
        f"the environment configures TensorCast: {env}"
    return Config.from_flat(dict(flat))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TENSORCAST_TOKEN"}
    return subprocess.run([sys.executable, "-m", "tensorcast", *args], capture_output=True, text=True, timeout=60,
                          env=env)


@pytest.mark.parametrize("flags", [["--host", EVERYWHERE], ["--set", f"metrics.host={EVERYWHERE}"]])
def test_the_commands_refuse_to_listen_everywhere_without_a_token(flags: list[str], tmp_path: Path) -> None:
    for command in (["gs", "--data-dir", str(tmp_path / "gs")],
                    ["worker", "--gs", "127.0.0.1:1", "--id", "w0"]):
        r = _cli(*command, *flags)
        assert r.returncode == 2 and "without a cluster token" in r.stderr and "Traceback" not in r.stderr, r.stderr


async def _serves_within(coro: object, seconds: float = 20.0) -> None:
    """Runs ``coro``; an entry point that starts serving instead of refusing is stopped and fails the test."""
    try:
        await asyncio.wait_for(coro, seconds)  # type: ignore[arg-type]
    except TimeoutError:
        raise AssertionError("it served beyond loopback without a token") from None


@pytest.mark.parametrize("flat", [{"gs.host": EVERYWHERE}, {"metrics.host": EVERYWHERE}])
def test_run_global_store_refuses_to_listen_everywhere(flat: dict[str, str], tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="without a cluster token"):
        asyncio.run(_serves_within(run_global_store(_tokenless(**flat), tmp_path)))
    assert not (tmp_path / "gs.sqlite3").exists()  # refused before anything was opened
    run = asyncio.run  # with a token, the same configuration is fine (stopped at once)

    async def with_token() -> None:
        stop = asyncio.Event()
        stop.set()
        await run_global_store(Config.from_flat({**flat, "token": "t0ken"}), tmp_path, stop=stop)

    run(with_token())


@pytest.mark.parametrize("flat", [{"worker.host": EVERYWHERE}, {"metrics.host": EVERYWHERE}])
def test_run_worker_refuses_to_listen_everywhere(flat: dict[str, str], tmp_path: Path) -> None:
    config = _tokenless(**flat, **{"worker.data_dir": str(tmp_path / "w0")})
    with pytest.raises(InvalidArgument, match="without a cluster token"):
        asyncio.run(_serves_within(run_worker(config, "w0", "127.0.0.1:1")))
    assert not (tmp_path / "w0").exists()  # refused before the data directory was claimed


def test_the_servers_refuse_too() -> None:
    """The check is in the servers themselves, whoever builds them."""
    with pytest.raises(InvalidArgument, match="data plane"):
        TcpDataServer(lambda req: None, WireConfig(), token=None).start(EVERYWHERE, 0)  # type: ignore[arg-type,return-value]

    async def rpc() -> None:
        await RpcServer(HandlerRegistry(), WireConfig(), token=None, server_id="x", host_id="h").start(EVERYWHERE, 0)

    with pytest.raises(InvalidArgument, match="RPC port"):
        asyncio.run(rpc())
    with pytest.raises(InvalidArgument, match="metrics endpoint"):
        asyncio.run(HttpServer(None).start(EVERYWHERE, 0))


def test_an_instance_runtime_refuses_to_listen_everywhere() -> None:
    class Idle:
        engine = "idle"

    runtime = InstanceRuntime(Idle(), "127.0.0.1:1", "i0", config=_tokenless(), host=EVERYWHERE)  # type: ignore[arg-type]
    try:
        with pytest.raises(InvalidArgument, match="without a cluster token"):
            runtime.start()
    finally:
        runtime.stop()
    metrics_everywhere = InstanceRuntime(Idle(), "127.0.0.1:1", "i1",  # type: ignore[arg-type]
                                         config=_tokenless(**{"metrics.host": EVERYWHERE}))
    try:
        with pytest.raises(InvalidArgument, match="metrics endpoint"):
            metrics_everywhere.start()
    finally:
        metrics_everywhere.stop()
