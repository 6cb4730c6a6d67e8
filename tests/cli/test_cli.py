"""The command line against a real cluster, as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from tensorcast.cluster import LocalCluster


def tc_cli(*args: str, address: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tensorcast", *args, "--address", address],
                          capture_output=True, text=True, timeout=60)


def test_put_get_ls_status_rm(shared_cluster: LocalCluster, tmp_path: Path) -> None:
    addr = shared_cluster.address
    arr = np.arange(12, dtype=np.int16).reshape(3, 4)
    np.save(tmp_path / "a.npy", arr)
    sd = {"w": np.ones((2, 3), np.float32), "b": np.zeros(3, np.float32)}
    save_file(sd, str(tmp_path / "m.safetensors"))

    r = tc_cli("put", str(tmp_path / "a.npy"), "cli/a", address=addr)
    assert r.returncode == 0, r.stderr
    r = tc_cli("put", str(tmp_path / "m.safetensors"), "cli/m", address=addr)
    assert r.returncode == 0, r.stderr

    assert tc_cli("get", "cli/a", str(tmp_path / "out.npy"), address=addr).returncode == 0
    assert np.array_equal(np.load(tmp_path / "out.npy"), arr)
    assert tc_cli("get", "cli/m", str(tmp_path / "out.safetensors"), address=addr).returncode == 0
    got = load_file(str(tmp_path / "out.safetensors"))
    assert set(got) == {"w", "b"} and np.array_equal(got["w"], sd["w"])

    ls = tc_cli("ls", "cli/", address=addr)
    assert ls.returncode == 0 and "cli/a" in ls.stdout and "cli/m" in ls.stdout
    status = tc_cli("status", address=addr)
    assert status.returncode == 0 and "w0" in status.stdout and "w1" in status.stdout

    for key in ("cli/a", "cli/m"):
        assert tc_cli("rm", key, address=addr).returncode == 0
    missing = tc_cli("get", "cli/a", str(tmp_path / "x.npy"), address=addr)
    assert missing.returncode == 2 and "NOT_FOUND" in missing.stderr and "Traceback" not in missing.stderr


def test_load_registers_a_checkpoint_and_warms_it(shared_cluster: LocalCluster, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    weights = {"model.layers.0.self_attn.q_proj.weight": torch.randn(64, 32), "model.norm.weight": torch.ones(32)}
    save_file(weights, str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text('{"model_type": "llama"}')
    r = tc_cli("load", str(ckpt), "cli/ckpt", "--warm", "w1", "--tp", "1/2", address=shared_cluster.address)
    assert r.returncode == 0, r.stderr
    assert "registered, not read" in r.stdout and "warm on w1" in r.stdout
    bad = tc_cli("load", str(tmp_path), "cli/bad", address=shared_cluster.address)
    assert bad.returncode == 2 and "NOT_FOUND" in bad.stderr
