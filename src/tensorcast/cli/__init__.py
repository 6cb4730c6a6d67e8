"""The ``tensorcast`` command line (the console script ``tensorcast`` and ``python -m tensorcast``).

Owns: nothing itself; it re-exports the command group ``main`` (``cli.commands``). The commands that use a
cluster are ``cli.commands``, those that run processes ``cli.procs`` (asking a running ``up`` through
``cli.control``), ``credential`` ``cli.credentials``; files in and out ``cli.files``, the status tables
``cli.status``, and what every command shares ``cli.common``. Does not own: what the processes do (``gs``,
``worker``, ``cluster``) or the client API (``client``).
"""

from tensorcast.cli.commands import main

__all__ = ["main"]
