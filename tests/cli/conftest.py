"""Running the command line as a user does: one fresh process per command, its output captured."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tensorcast.cluster import LocalCluster


class CLI:
    """``cli("put", FILE, KEY)`` runs ``tensorcast put FILE KEY [--address ADDRESS]`` in a new process."""

    def __init__(self, address: str | None) -> None:
        self.address = address

    def __call__(self, *args: str, env: dict[str, str | None] | None = None,
                 timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """``env`` adds variables to this process's environment (a None value removes one)."""
        full = dict(os.environ, COLUMNS="250")  # tables unwrapped, so that a row is one line
        for name, value in (env or {}).items():
            if value is None:
                full.pop(name, None)
            else:
                full[name] = value
        where = ["--address", self.address] if self.address else []
        return subprocess.run([sys.executable, "-m", "tensorcast", *args, *where], capture_output=True, text=True,
                              timeout=timeout, env=full)

    @staticmethod
    def assert_one_line_error(r: subprocess.CompletedProcess[str], *needles: str) -> None:
        """Exit code 2 and one ``error ...`` line on stderr mentioning every needle: no traceback."""
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error "), (r.returncode, r.stderr)
        for needle in needles:
            assert needle in lines[0], (needle, lines[0])


@pytest.fixture()
def cli(shared_cluster: LocalCluster) -> CLI:
    """The command line against the session's shared cluster."""
    return CLI(shared_cluster.address)


@pytest.fixture()
def cli_anywhere() -> CLI:
    """The command line without an address: pass ``--address`` or set TENSORCAST_ADDRESS yourself."""
    return CLI(None)
