"""Which checkpoint files a worker may open, and opening them so that no file can hang or fool it.

Owns: the allowed roots (``weights.allowed_roots`` and the worker's data dir: a path, resolved through every
symlink, must lie under one of them, or ``from_disk`` is refused with ``PermissionDenied`` before a byte is
read), opening only regular files (``O_NOFOLLOW | O_NONBLOCK``: a FIFO or a device in a checkpoint directory is
refused at once instead of parking a thread), and a file's identity (size and mtime), which a read compares
before and after so that a file rewritten or truncated under it is refused instead of returning other bytes.

Errors name the file, never its contents. Does not own: parsing headers (``weights.safetensors``) or reading
bytes (``weights.reader``). A directory component swapped for a symlink between the check and the open is not
caught (the last component is, by ``O_NOFOLLOW``); the roots are for operators' directories, not for racing
local attackers who can already write there.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

from tensorcast.errors import InvalidArgument, NotFound, PermissionDenied

__all__ = ["CheckpointRoots", "FileIdentity", "check_unchanged", "identity", "open_regular"]

_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

FileIdentity = tuple[int, int]  # (size, mtime in ns)


class CheckpointRoots:
    """The directories a worker reads checkpoints from, resolved once (relative ones against the worker's cwd)."""

    def __init__(self, roots: Iterable[str]) -> None:
        self.roots = tuple(dict.fromkeys(os.path.realpath(r) for r in roots if r))

    def check(self, path: str | os.PathLike[str]) -> Path:
        """``path`` with every symlink resolved, if it lies under a root; else ``PermissionDenied``."""
        try:
            real = Path(path).resolve(strict=True)
        except FileNotFoundError:
            raise NotFound(f"checkpoint {path} does not exist") from None
        except (OSError, RuntimeError) as exc:  # a symlink loop, a component that is not a directory
            raise InvalidArgument(f"checkpoint {path} cannot be resolved: {exc.__class__.__name__}") from None
        if not any(real == Path(r) or real.is_relative_to(r) for r in self.roots):
            allowed = ", ".join(self.roots) or "none"
            raise PermissionDenied(f"{path} is outside the directories this worker reads checkpoints from "
                                   f"(weights.allowed_roots and the worker's data dir: {allowed})")
        return real


def open_regular(path: str | os.PathLike[str]) -> int:
    """A read-only descriptor of ``path``, which must be a regular file (not a symlink, FIFO or device)."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise NotFound(f"checkpoint file {path} does not exist") from None
    except OSError as exc:  # ELOOP: a symlink put in its place; EACCES; ENXIO: a FIFO with no writer
        raise InvalidArgument(f"checkpoint file {path} cannot be opened: {os.strerror(exc.errno or 0)}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise InvalidArgument(f"checkpoint file {path} is not a regular file")
        os.set_blocking(fd, True)  # no effect on a regular file's reads, but the flag need not linger
    except BaseException:
        os.close(fd)
        raise
    return fd


def identity(fd: int) -> FileIdentity:
    st = os.fstat(fd)
    return st.st_size, st.st_mtime_ns


def check_unchanged(fd: int, path: str, before: FileIdentity) -> None:
    """Refuse what was read from ``fd`` when the file changed meanwhile (rewritten in place, truncated)."""
    now = identity(fd)
    if now != before:
        raise InvalidArgument(f"checkpoint file {path} changed while it was read (size/mtime {before} -> {now}); "
                              "register it again")
