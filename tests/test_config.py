from __future__ import annotations

import pytest

from tensorcast.config import Config
from tensorcast.config_loading import parse_size
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


def test_kubernetes_service_variables_are_not_configuration(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # What a pod gets for a Service named "tensorcast-gs" (and "tensorcast-worker") in its namespace.
    for name, value in {"TENSORCAST_GS_SERVICE_HOST": "10.0.0.7", "TENSORCAST_GS_SERVICE_PORT": "7070",
                        "TENSORCAST_GS_SERVICE_PORT_METRICS": "9400", "TENSORCAST_GS_PORT": "tcp://10.0.0.7:7070",
                        "TENSORCAST_GS_PORT_7070_TCP": "tcp://10.0.0.7:7070",
                        "TENSORCAST_GS_PORT_7070_TCP_ADDR": "10.0.0.7", "TENSORCAST_WORKER_PORT_7071_TCP_PORT": "7071",
                        "TENSORCAST_WORKER_PORT": "tcp://10.0.0.8:7071"}.items():
        monkeypatch.setenv(name, value)
    config = Config.load()
    assert config.gs.port == 0 and config.worker.port == 0
    monkeypatch.setenv("TENSORCAST_GS_PORT", "7070")  # a real setting still counts
    assert Config.load().gs.port == 7070
    monkeypatch.setenv("TENSORCAST_GS_SERVIC_HOST", "x")  # and a typo is still an error
    with pytest.raises(InvalidArgument, match=r"gs\.servic_host"):
        Config.load()
