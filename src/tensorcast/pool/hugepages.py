"""Whether the pool's shared memory gets huge pages: the ``huge=`` option of the tmpfs mount that holds it.

Owns: reading that option (``shm_huge_pages``; ``huge_pages_option`` parses a ``/proc/mounts`` text, for
tests) and the advice a worker logs at start when its memory tier would get 4 KiB pages. With 4 KiB pages,
every segment costs a page fault per 4 KiB on first touch (in each process that maps it) and a TLB entry
per 4 KiB on every copy; on a virtual machine both are several times dearer than on bare metal. Measured on
a 2-vCPU VM: copying 16 MiB into a pre-faulted segment took 3-5 ms with 4 KiB pages and 2.0 ms with 2 MiB
ones (``memcpy`` into private memory: 1.0-1.2 ms), and faulting in 256 MiB took 0.5-0.7 s against
0.03-0.7 s. ``docs/deployment.md`` says how to mount ``/dev/shm`` with ``huge=within_size``. Does not own:
allocating segments (``pool.segments``), or changing the mount (an operator's decision).
"""

from __future__ import annotations

import logging
import os

__all__ = ["HUGE_PAGE_ADVICE", "advise_if_small_pages", "huge_pages_option", "shm_huge_pages"]

log = logging.getLogger("tensorcast.pool")

# Segments are files created with posix_fallocate (a full tmpfs is a clean error, not a SIGBUS), which takes
# the mount's policy as it stands: "advise" would need an madvise before the pages exist, so only these two
# give the pool huge pages.
_HUGE = ("always", "within_size")
HUGE_PAGE_ADVICE = ("shared memory in {dir} uses 4 KiB pages (tmpfs huge={option}): puts and prefetches copy "
                    "2-5x slower than with huge pages; mount it with huge=within_size (docs/deployment.md)")


def huge_pages_option(mounts: str, path: str) -> str:
    """The ``huge=`` option (``never`` when absent) of the mount in ``mounts`` (``/proc/mounts`` format) that
    holds ``path``: the one with the longest mount point that is ``path`` or one of its parents."""
    best, option = "", "never"
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        point = fields[1].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best = point
            opts = [o.partition("=") for o in fields[3].split(",")]
            huge = [value for key, _, value in opts if key == "huge"]
            option = huge[-1] if huge and fields[2] == "tmpfs" else "never"
    return option


def shm_huge_pages(path: str) -> tuple[bool, str]:
    """Whether segments created under ``path`` get huge pages, and the mount's ``huge=`` option (``unknown``
    where ``/proc/mounts`` cannot be read)."""
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            option = huge_pages_option(f.read(), os.path.realpath(path))
    except OSError:
        return False, "unknown"
    return option in _HUGE, option


def advise_if_small_pages(path: str) -> None:
    """Log, once per worker start, that ``path`` would give the pool 4 KiB pages (and what to do)."""
    huge, option = shm_huge_pages(path)
    if not huge:
        log.info(HUGE_PAGE_ADVICE.format(dir=path, option=option))
