"""Which page size the pool's shared memory gets: the ``huge=`` option of the tmpfs mount that holds it."""

from __future__ import annotations

import logging

import pytest

from tensorcast.pool import hugepages
from tensorcast.pool.hugepages import huge_pages_option, shm_huge_pages

MOUNTS = """\
proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0
tmpfs /dev/shm tmpfs rw,relatime,size=24684084k 0 0
tmpfs /dev/shm/pool tmpfs rw,relatime,size=8g,huge=within_size 0 0
/dev/vda / ext4 rw,relatime 0 0
tmpfs /mnt/my\\040pool tmpfs rw,huge=always 0 0
tmpfs /run tmpfs rw,huge=advise 0 0
"""


def test_the_innermost_mount_holding_the_path_decides() -> None:
    assert huge_pages_option(MOUNTS, "/dev/shm") == "never"  # no huge= option: the kernel's default
    assert huge_pages_option(MOUNTS, "/dev/shm/pool") == "within_size"
    assert huge_pages_option(MOUNTS, "/dev/shm/pool/x") == "within_size"
    assert huge_pages_option(MOUNTS, "/dev/shm/poolx") == "never"  # a sibling, not inside
    assert huge_pages_option(MOUNTS, "/mnt/my pool") == "always"  # an escaped space in the mount point
    assert huge_pages_option(MOUNTS, "/run/x") == "advise"
    assert huge_pages_option(MOUNTS, "/home") == "never"  # ext4 at /: not tmpfs


def test_a_worker_is_told_when_its_memory_gets_small_pages(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    for option, huge in (("never", False), ("advise", False), ("within_size", True), ("always", True)):
        monkeypatch.setattr(hugepages, "huge_pages_option", lambda _m, _p, o=option: o)
        assert shm_huge_pages("/dev/shm") == (huge, option)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tensorcast.pool"):
            hugepages.advise_if_small_pages("/dev/shm")
        assert ("huge=within_size" in caplog.text) is not huge
