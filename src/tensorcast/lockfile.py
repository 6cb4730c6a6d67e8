"""Who owns a data directory: an exclusive lock held for the life of the owning process.

Owns: ``DIR/owner.lock`` — an ``flock`` taken without waiting, and a small JSON inside the file saying who holds
it (pid, command, and whatever the owner adds later, such as its address), so that a second process that
wants the directory fails at once with a one-line error naming the holder. The kernel drops the lock when
the holder's process ends, however it ends (kill -9 included), so a lock never outlives its owner and a
stale file is simply taken over. The descriptor is not inherited by children. Does not own: what the
directory holds, or who owns which directory (``tensorcast up``/``LocalCluster`` the whole data directory,
the global store ``DATA_DIR/gs``, worker ``ID`` ``DATA_DIR/workers/ID``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from tensorcast.errors import InvalidArgument

__all__ = ["LOCK_NAME", "DirLock", "command_line", "holder", "is_held", "writable_dir"]

LOCK_NAME = "owner.lock"


def writable_dir(directory: Path, what: str = "data directory") -> Path:
    """``directory``, created if missing; ``InvalidArgument`` (one line, naming it) when it cannot be
    created or written."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidArgument(f"{what} {directory}: cannot create it ({exc.strerror or exc})") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise InvalidArgument(f"{what} {directory}: not writable by this user")
    return directory


def command_line() -> str:
    """This process's command line, as a user would type it (``tensorcast up ...``), cut to 200 characters."""
    if not sys.argv:
        return ""
    first = Path(sys.argv[0])
    name = "tensorcast" if first.parts[-2:] == ("tensorcast", "__main__.py") else first.name
    line = " ".join([name, *sys.argv[1:]])
    return line if len(line) <= 200 else line[:197] + "..."


def _describe(info: dict[str, Any]) -> str:
    parts = [f"pid {info.get('pid', '?')}"]
    if info.get("command"):
        parts.append(str(info["command"]))
    if info.get("address"):
        parts.append(f"address {info['address']}")
    return ", ".join(parts)


def _read(fd: int) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        raw = os.pread(fd, 65536, 0)
        info = json.loads(raw) if raw.strip() else {}
        if isinstance(info, dict):
            return info
    return {}


class DirLock:
    """``DIR/owner.lock``, held exclusively until ``release()`` or the end of this process."""

    def __init__(self, directory: Path, fd: int, previous: dict[str, Any], info: dict[str, Any]) -> None:
        self.directory = directory
        self.path = directory / LOCK_NAME
        self._fd: int | None = fd
        self.previous = previous  # what the last holder wrote (it has ended: its lock was free)
        self.info = info

    @classmethod
    def acquire(cls, directory: str | os.PathLike[str], what: str = "data directory",
                **info: Any) -> DirLock:
        """Take the directory or raise ``InvalidArgument`` saying who holds it. ``info`` goes into the lock
        file beside this process's pid and command line."""
        path = writable_dir(Path(directory), what)
        try:
            fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise InvalidArgument(f"{what} {path}: cannot write {LOCK_NAME} ({exc.strerror or exc})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            held_by = _read(fd)
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise InvalidArgument(f"{what} {path}: cannot lock {LOCK_NAME} ({exc.strerror or exc})") from None
            raise InvalidArgument(f"{what} {path} is in use by another process ({_describe(held_by)}); stop it "
                                  "first or choose another directory") from None
        lock = cls(path, fd, _read(fd), {})
        lock.update(pid=os.getpid(), command=command_line(), started_at=time.time(), **info)
        return lock

    def update(self, **info: Any) -> None:
        """Add ``info`` to what the lock file says about its holder."""
        if self._fd is None:
            return
        self.info.update(info)
        data = json.dumps(self.info).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


def is_held(directory: str | os.PathLike[str]) -> bool:
    """Whether a live process holds ``DIR/owner.lock`` now."""
    try:
        fd = os.open(Path(directory) / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # a shared lock we took goes with the descriptor
    return False


def holder(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """What the holder (or the last holder) of ``DIR/owner.lock`` wrote there; {} when there is none."""
    try:
        fd = os.open(Path(directory) / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return {}
    try:
        return _read(fd)
    finally:
        os.close(fd)
