from __future__ import annotations

import pytest

from tensorcast.config import Config, parse_size
from tensorcast.errors import InvalidArgument


def test_sizes() -> None:
    assert parse_size("4GiB") == 4 << 30
    assert parse_size("1.5MB") == 1_500_000
    assert parse_size(42) == 42
    for bad in ("lots", "-1", "4 GiBs", True):
        with pytest.raises(InvalidArgument):
            parse_size(bad)  # type: ignore[arg-type]


def test_layers_and_validation(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "tc.toml"
    f.write_text('token = "t"\n[worker]\nmemory_capacity = "2GiB"\nheartbeat_interval = 0.5\n')
    monkeypatch.setenv("TENSORCAST_WORKER_HEARTBEAT_INTERVAL", "0.25")
    cfg = Config.load(f, {"worker.roles": "basic"})
    assert cfg.token == "t"
    assert cfg.worker.memory_capacity == 2 << 30
    assert cfg.worker.heartbeat_interval == 0.25
    assert cfg.worker.roles == ("basic",)
    with pytest.raises(InvalidArgument, match="unknown config key"):
        Config.from_flat({"worker.nope": 1})
    with pytest.raises(InvalidArgument, match=r"worker\.heartbeat_interval"):
        Config.from_flat({"worker.heartbeat_interval": "soon"})
    with pytest.raises(InvalidArgument, match="verify_local_puts"):
        Config.from_flat({"worker.verify_local_puts": "maybe"})
