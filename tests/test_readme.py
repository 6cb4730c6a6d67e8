"""Every README snippet runs as written: each ```python block in a fresh interpreter, and the ```bash blocks of
the command-line section in a shell against the ``tensorcast up`` they start, each in an empty directory with a
time limit. The set-up blocks (creating a virtualenv, running the tests) are never run."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SNIPPET_TIMEOUT = 240
# Blocks that install or test the project: running them here would recurse or reinstall.
NEVER_RUN = ("-m venv", "pytest")


@dataclass(frozen=True)
class Snippet:
    section: str
    lang: str
    code: str
    line: int  # where the block starts in README.md

    def __str__(self) -> str:
        return f"README.md:{self.line}"


def _snippets() -> list[Snippet]:
    out: list[Snippet] = []
    section = ""
    fence = re.compile(r"^```(\w+)\n(.*?)^```$", re.S | re.M)
    text = README.read_text()
    for m in re.finditer(r"^## ([^\n]+)$|" + fence.pattern, text, re.S | re.M):
        if m[1]:
            section = m[1].strip()
        elif not any(marker in m[3] for marker in NEVER_RUN):
            out.append(Snippet(section, m[2], m[3], text.count("\n", 0, m.start()) + 1))
    return out


PYTHON = [s for s in _snippets() if s.lang == "python"]
COMMAND_LINE = [s for s in _snippets() if s.lang == "bash" and s.section == "Command line"]


def _env() -> dict[str, str]:
    """This interpreter's environment and its ``tensorcast`` script first on PATH, with no cluster address
    from outside: the snippets find their own (and read checkpoints where a newcomer's cluster would)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TENSORCAST_ADDRESS", "TENSORCAST_WEIGHTS_ALLOWED_ROOTS")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def _run(cmd: list[str], cwd: Path, what: Snippet) -> None:
    """Run ``cmd`` in its own process group; fail with its output if it fails, times out or leaves a process
    (a cluster it started) behind. Whatever is left is killed either way."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=SNIPPET_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{what} did not finish within {SNIPPET_TIMEOUT}s:\n{what.code}\n--- output ---\n{output}")
    left = _group_members(proc.pid)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, f"{what} exited with {proc.returncode}:\n{what.code}\n--- output ---\n{output}"
    assert not left, f"{what} left processes running: {left}\n--- output ---\n{output}"


def test_the_readme_has_the_snippets_this_test_runs() -> None:
    assert len(PYTHON) >= 5 and any(s.code.startswith("tensorcast up") for s in COMMAND_LINE)
    set_up = [s for s in re.findall(r"^```bash\n(.*?)^```$", README.read_text(), re.S | re.M)
              if any(marker in s for marker in NEVER_RUN)]
    assert len(set_up) == 2  # the venv + quickstart command and the test command: skipped by content


@pytest.mark.parametrize("snippet", PYTHON, ids=str)
def test_python_snippet_runs(snippet: Snippet, tmp_path: Path) -> None:
    (tmp_path / "snippet.py").write_text(snippet.code)
    _run([sys.executable, "snippet.py"], tmp_path, snippet)


def test_command_line_snippets_run(tmp_path: Path) -> None:
    """``tensorcast up`` blocks start in the background (as in a second terminal); the others run in order with
    ``bash -e`` against that cluster, which is then stopped with Ctrl-C's SIGINT."""
    servers = [s for s in COMMAND_LINE if s.code.startswith("tensorcast up")]
    assert len(servers) == 1 and servers[0].code.count("\n") == 1 and "./tc-data" in servers[0].code
    up = subprocess.Popen(["bash", "-c", f"exec {servers[0].code}"], cwd=tmp_path, env=_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "tc-data" / "cluster.json").exists():
            assert up.poll() is None and time.monotonic() < deadline, "tensorcast up did not start"
            time.sleep(0.1)
        for snippet in COMMAND_LINE:
            if snippet not in servers:
                (tmp_path / "snippet.sh").write_text(snippet.code)
                _run(["bash", "-e", "snippet.sh"], tmp_path, snippet)
    finally:
        up.send_signal(signal.SIGINT)
        try:
            output, _ = up.communicate(timeout=30)
        finally:
            for pid in _group_members(up.pid):
                os.kill(pid, signal.SIGKILL)
    assert up.returncode == 0, output
