"""System tools that tests drive (etcd, Prometheus, Chromium, iproute2): found, or the test is skipped saying
how to install it, or failed where ``TENSORCAST_REQUIRE_SYSTEM_TOOLS=1`` (CI, which installs them all)."""

from __future__ import annotations

import os
import shutil

__all__ = ["require_tool"]


def require_tool(path: str, package: str) -> str:
    import pytest

    found = shutil.which(path)
    if found:
        return found
    why = f"{path} not found: apt-get install {package}"
    if os.environ.get("TENSORCAST_REQUIRE_SYSTEM_TOOLS") == "1":
        pytest.fail(why)
    pytest.skip(why)
