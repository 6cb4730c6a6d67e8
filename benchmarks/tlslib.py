"""What TLS and the credential handshake cost: the clusters to compare, and the handshake's own price.

``pair`` starts two otherwise equal clusters with a token, one in plain text and one with TLS on every port
(certificates made at run time), so that a benchmark measures both in the same run, interleaved round by round.
``handshakes`` times opening a connection and completing the handshake, to a gateway's RPC port and to a data
port: without a token (Hello -> Welcome), with one (the challenge-response, in plain text) and with TLS too.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

import tensorcast as tc
from benchlib import Table
from tensorcast.config import Config
from tensorcast.transport.tcp import TcpTransport
from tensorcast.wire.caller import Caller
from tensorcast.wire.messages import DataRequest

SECRET = "bench-secret"


@contextlib.contextmanager
def pair(**kwargs: Any) -> Iterator[dict[str, tc.LocalCluster]]:
    """``{"plain": cluster, "tls": cluster}``, both with a token, configured alike otherwise."""
    with tc.LocalCluster(token=SECRET, **kwargs) as plain, tc.LocalCluster(token=SECRET, tls=True, **kwargs) as tls:
        yield {"plain": plain, "tls": tls}


def connect(cluster: tc.LocalCluster, **flat: str) -> tc.Client:
    config = Config.load(None, {**cluster.config, **flat})
    return tc.connect(cluster.address, token=cluster.credential("client"), config=config)


def _rpc(cluster: tc.LocalCluster, token: str | None, n: int) -> list[float]:
    config = cluster.client_config()

    async def run() -> list[float]:
        out = []
        for _ in range(n):
            caller = Caller(config.wire, token=token, peer_id="bench", host_id="bench", tls=config.tls)
            t0 = time.perf_counter()
            await caller.connect(cluster.address)
            out.append(time.perf_counter() - t0)
            await caller.close()
        return out

    return asyncio.run(run())


def _data(cluster: tc.LocalCluster, token: str | None, art_id: str, n: int) -> list[float]:
    """A fresh data-plane connection (its handshake) and one 4 KiB range read on it."""
    config = cluster.client_config()
    address = str(cluster.workers["w0"].info["data_address"])  # type: ignore[index]
    dest = memoryview(bytearray(4096))
    out = []
    for _ in range(n):
        transport = TcpTransport(config.wire, token=token, max_streams=1, tls=config.tls)
        t0 = time.perf_counter()
        transport.fetch(address, DataRequest(artifact_id=art_id, name="t"), dest)
        out.append(time.perf_counter() - t0)
        transport.close()
    return out


def handshakes(n: int) -> list[dict[str, float]]:
    """Median seconds to connect and authenticate, per port and mode; ratios to the mode without a token."""
    rows: list[dict[str, float]] = []
    modes = [("no token", None, False), ("token", SECRET, False), ("token + TLS", SECRET, True)]
    base: dict[str, float] = {}
    for name, token, tls in modes:
        with tc.LocalCluster(token=token, tls=tls, config={"worker.prefault_bytes": 0}) as cluster:
            with tc.connect(cluster.address, token=token, config=cluster.client_config()) as c:
                art = c.put({"t": np.ones(4096, np.uint8)})
            rpc = statistics.median(_rpc(cluster, token, n))
            data = statistics.median(_data(cluster, token, art.id, n))
        base = base or {"rpc": rpc, "data": data}
        rows.append({"mode": name, "rpc_connect_s": rpc, "data_connect_and_read_s": data,  # type: ignore[dict-item]
                     "rpc_vs_no_token": rpc / base["rpc"], "data_vs_no_token": data / base["data"]})
    print()
    table = Table(("new connection", "<14"), ("RPC ms", ">8.2f"), ("x", ">6.2f"), ("data+4KiB ms", ">13.2f"),
                  ("x", ">6.2f"))
    table.header()
    for r in rows:
        table.row(r["mode"], r["rpc_connect_s"] * 1e3, r["rpc_vs_no_token"], r["data_connect_and_read_s"] * 1e3,
                  r["data_vs_no_token"])
    return rows
