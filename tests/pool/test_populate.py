"""``populate_read`` maps a private mapping's pages in ahead of the copy that reads them (a mapped staging
tensor before activation): checked by the mapping's resident pages in ``/proc/self/smaps``."""

from __future__ import annotations

import os
import platform
import re
import uuid

import numpy as np
import pytest

from tensorcast.pool.segments import map_private, populate_read

MiB = 1 << 20


def _resident_kib(address: int) -> int:
    """Rss of the mapping that contains ``address``."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "Rss:":
                return int(line.split()[1])
    raise AssertionError("no mapping holds the address")


def _kernel_has_populate() -> bool:
    found = re.match(r"(\d+)\.(\d+)", platform.release())
    return found is not None and (int(found[1]), int(found[2])) >= (5, 14)


def _shm_huge_pages() -> bool:
    """/dev/shm backed by huge pages: resident sizes then move in 2 MiB steps."""
    with open("/proc/mounts") as f:
        opts = next((line.split()[3] for line in f if line.split()[1:2] == ["/dev/shm"]), "")
    if "huge=" in opts and "huge=never" not in opts:
        return True
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            return "[force]" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not _kernel_has_populate(), reason="MADV_POPULATE_READ needs Linux 5.14 (best effort before)")
@pytest.mark.skipif(_shm_huge_pages(), reason="/dev/shm uses huge pages: the 4 KiB page bounds do not apply")
def test_populate_read_maps_in_exactly_the_range_asked() -> None:
    path = f"/dev/shm/tc-test-populate-{uuid.uuid4().hex[:8]}"
    with open(path, "wb") as f:
        f.write(np.arange(8 * MiB // 8, dtype=np.int64).tobytes())
    try:
        whole = map_private(path, [(0, 8 * MiB)])[0]
        arr = np.frombuffer(whole, np.int64)
        address = arr.ctypes.data
        assert _resident_kib(address) < 64  # nothing read yet: no page mapped in
        populate_read(address + 2 * MiB + 100, 3 * MiB)  # from mid-page: its page is taken too
        resident = _resident_kib(address)
        # The pages asked for, plus at most the kernel's read fault-around (64 KiB) past the end.
        assert 3 * 1024 <= resident <= 3 * 1024 + 4 + 64, resident
        assert int(arr[-1]) == 8 * MiB // 8 - 1  # the bytes are the file's, the mapping still private
    finally:
        os.unlink(path)
