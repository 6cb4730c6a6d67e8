"""The process mechanics under ``LocalCluster``: one handle per child, started so that it dies with its parent,
its ready file waited for, a failed start said in one line, and the wait for the KV shard table to settle.

Owns: ``ProcessHandle``; spawning (stdin closed, output appended to the child's log, its environment marked by
``lifetime.child_env``); waiting for a ready file, with a start-up failure reported as the child's own last
line (its one-line error, or the last line of a traceback) and its log; stopping handles (SIGCONT first, so a
paused one can take its SIGTERM; SIGKILL after a timeout); the ports of a cluster whose configuration fixes a
base (``port_for``); and polling the shard table until ``kv.settle`` says it has settled. Does not own: which
processes a cluster has or their arguments (``cluster``), or what settled means (``kv.settle``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from tensorcast.context import CallContext
from tensorcast.errors import InvalidArgument, TensorCastError, Unavailable
from tensorcast.lifetime import child_env

if TYPE_CHECKING:
    from tensorcast.config import Config
    from tensorcast.wire.caller import Caller

__all__ = ["KILL_GRACE", "TERM_TIMEOUT", "ProcessHandle", "exit_reason", "port_for", "settle_timeout", "stop_handles",
           "wait_settled"]

log = logging.getLogger("tensorcast.cluster")

# Longest a worker may take to drain and exit after SIGTERM before it is killed.
STOP_TIMEOUT = 60.0
# Seconds a process told to stop (SIGTERM) may take before it is killed (each in turn: stop_handles).
TERM_TIMEOUT = 10.0
# Seconds a killed process may take to end: until the kernel has freed its memory, which for GiBs of shared
# memory being faulted in on a busy host took more than 10 s (seen: a worker pre-faulting its stock).
KILL_GRACE = 60.0


@dataclass
class ProcessHandle:
    name: str
    args: list[str]
    ready_file: Path
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    info: dict[str, Any] | None = None
    host: int = 0  # the (simulated) host index the process runs on
    _log: IO[bytes] | None = field(default=None, repr=False)
    _log_start: int = field(default=0, repr=False)  # where this run's output begins in the (appended) log
    _signalled: int = field(default=0, repr=False)  # the pid last told to stop

    @property
    def stopping(self) -> bool:
        """This run of the process was told to stop already."""
        return self.popen is not None and self._signalled == self.popen.pid

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    @property
    def address(self) -> str:
        assert self.info is not None
        return str(self.info["address"])

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def spawn(self, env: dict[str, str]) -> None:
        """Start the process (again), to die with this one (``lifetime``)."""
        self.ready_file.unlink(missing_ok=True)
        self.info = None
        self.close_log()
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - kept open for the child's lifetime
        self._log_start = self._log.tell()
        self.popen = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=child_env(env),
                                      stdin=subprocess.DEVNULL)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.ready_file.exists():
                self.info = json.loads(self.ready_file.read_text())
                return
            if self.popen is not None and self.popen.poll() is not None:
                raise self._start_failure(self.popen.returncode)
            time.sleep(0.02)
        raise Unavailable(f"{self.name} not ready after {timeout}s (log: {self.log_path})")

    def _start_failure(self, returncode: int) -> TensorCastError:
        """One line: the child's own last words (its ``error ...`` line, or a traceback's last line)."""
        with open(self.log_path, "rb") as f:
            f.seek(self._log_start)
            output = f.read().decode(errors="replace")
        lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
        said = next((ln for ln in reversed(lines) if ln.startswith("error ")), lines[-1] if lines else "")
        said = said.removeprefix("error ")
        message = f"{self.name} exited during start-up ({exit_reason(returncode)}): {said or 'no output'} " \
                  f"(log: {self.log_path})"
        # Exit code 2: the command line refused its arguments (a port in use, a directory held): the caller's to fix.
        return InvalidArgument(message) if returncode == 2 else Unavailable(message)

    def terminate(self) -> None:
        """SIGTERM (a worker drains first); a stopped process is woken to take it."""
        self._signal(signal.SIGTERM)

    def interrupt(self) -> None:
        """SIGINT: stop at once (a worker hands nothing over)."""
        self._signal(signal.SIGINT)

    def _signal(self, sig: int) -> None:
        if self.alive():
            assert self.popen is not None
            self._signalled = self.popen.pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
                self.popen.send_signal(sig)

    def wait_exit(self, timeout: float) -> int:
        """Wait for the process to end (killed after ``timeout``); its return code."""
        assert self.popen is not None
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            try:
                self.popen.wait(timeout=KILL_GRACE)
            except subprocess.TimeoutExpired:  # still in the kernel: it can do nothing more; say so, go on
                log.warning("%s (pid %d) was killed but had not ended %.0f s later", self.name, self.pid,
                            KILL_GRACE)
                return -signal.SIGKILL
        return int(self.popen.returncode)

    def close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def exit_reason(returncode: int) -> str:
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-returncode).name}"
        return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


def stop_handles(handles: list[ProcessHandle], timeout: float = TERM_TIMEOUT) -> None:
    """SIGTERM every running handle (unless it was told to stop already), then wait for each (SIGKILL after
    ``timeout``)."""
    for h in handles:
        if h.popen is not None and not h.stopping:
            h.terminate()
    for h in handles:
        if h.popen is not None:
            h.wait_exit(timeout)
        h.close_log()


def port_for(base: int, offset: int) -> int:
    """A process's port when the configuration fixes ``base`` for every process of a cluster: the global
    stores first (``base``, ``base + 1``, ...), then the workers in the order they were created. 0 (a free
    port each) stays 0."""
    return base + offset if base else 0


def settle_timeout(lease_ttl: float, renew_interval: float, cap: float) -> float:
    """How long to wait for the shard table to settle: shards move within a lease TTL and a renewal after a
    home appears or goes; ten times that leaves room for a busy machine, at least 15 s, at most ``cap``."""
    return min(cap, max(15.0, 10 * (lease_ttl + renew_interval)))


def wait_settled(address: str, token: str | None, lease_ttl: float, timeout: float,
                 gone: frozenset[str] = frozenset(), config: Config | None = None) -> None:
    """Until every KV shard is held by its rank-0 live shard home (``kv.settle``), or ``Unavailable``; ``gone``:
    workers just stopped, no longer homes although their last heartbeat is recent. Nothing to wait for when no
    worker has the shard-home role. The polls carry no trace id: they are the cluster's own bookkeeping, not a
    caller's operation (a tracer in this process would otherwise record them, and the processes follow it)."""
    from tensorcast.client.aio import connect
    from tensorcast.client.loop import LoopThread

    loop = LoopThread("tensorcast-settle")
    try:
        client = loop.run(connect(address, token, config=config))
        try:
            loop.run(_settle(client.caller, lease_ttl, timeout, gone))
        finally:
            loop.run(client.close())
    finally:
        loop.stop()


async def _settle(caller: Caller, lease_ttl: float, timeout: float, gone: frozenset[str]) -> None:
    from tensorcast.kv.settle import live_homes, unsettled
    from tensorcast.wire.kv_messages import ListShards
    from tensorcast.wire.messages import ListWorkers

    deadline = time.monotonic() + timeout
    while True:
        untraced = CallContext(trace_id="", deadline=time.time() + 10.0)
        listed = await caller.call(ListWorkers(), untraced)
        workers = [w for w in listed.workers if w.worker_id not in gone]
        if not any("shard-home" in w.roles for w in workers):
            return
        table = await caller.call(ListShards(), untraced)
        homes = live_homes(workers, table.now, lease_ttl)
        left = unsettled(table.num_shards, table.leases, homes, table.now)
        if not left:
            return
        if time.monotonic() > deadline:
            raise Unavailable(f"the KV shard table did not settle within {timeout:g} s: {len(left)} of "
                              f"{table.num_shards} shards not held by their HRW home among {homes}")
        await asyncio.sleep(0.1)
