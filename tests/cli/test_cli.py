"""The command line against a real cluster, as a user runs it: client commands, file problems, safetensors
metadata, tokens, placement presets, progress and sizes."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import tensorcast as tc
from tensorcast.cli.files import size
from tensorcast.cli.status import memory_cell
from tensorcast.cluster import LocalCluster
from tensorcast.testing import running_cluster


def test_put_get_ls_status_rm(cli: Any, tmp_path: Path) -> None:
    arr = np.arange(12, dtype=np.int16).reshape(3, 4)
    np.save(tmp_path / "a.npy", arr)
    sd = {"w": np.ones((2, 3), np.float32), "b": np.zeros(3, np.float32)}
    save_file(sd, str(tmp_path / "m.safetensors"))

    r = cli("put", str(tmp_path / "a.npy"), "cli/a")
    assert r.returncode == 0 and "(1 tensors, 24 B)" in r.stdout, r.stderr
    r = cli("put", str(tmp_path / "m.safetensors"), "cli/m")
    assert r.returncode == 0 and r.stderr == "", r.stderr  # small files: no progress output

    assert cli("get", "cli/a", str(tmp_path / "out.npy")).returncode == 0
    assert np.array_equal(np.load(tmp_path / "out.npy"), arr)
    assert cli("get", "cli/m", str(tmp_path / "out.safetensors")).returncode == 0
    got = load_file(str(tmp_path / "out.safetensors"))
    assert set(got) == {"w", "b"} and np.array_equal(got["w"], sd["w"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "m.safetensors", "out.npy", "out.safetensors"]

    ls = cli("ls", "cli/")
    assert ls.returncode == 0 and "cli/a" in ls.stdout and "cli/m" in ls.stdout
    status = cli("status")
    assert status.returncode == 0 and "w0" in status.stdout and "w1" in status.stdout

    for key in ("cli/a", "cli/m"):
        assert cli("rm", key).returncode == 0
    cli.assert_one_line_error(cli("get", "cli/a", str(tmp_path / "x.npy")), "NOT_FOUND")
    assert not (tmp_path / "x.npy").exists() and not list(tmp_path.glob(".*.part"))


def test_ls_shows_every_key_and_rm_of_one_keeps_the_other(cli: Any, tmp_path: Path) -> None:
    """Equal bytes under two keys: one row per key (one id), and removing one key keeps the bytes under
    the other."""
    arr = np.arange(6, dtype=np.int32)
    np.save(tmp_path / "x.npy", arr)
    for key in ("cli/same-a", "cli/same-b"):
        assert cli("put", str(tmp_path / "x.npy"), key).returncode == 0

    def rows() -> dict[str, str]:
        ls = cli("ls", "cli/same-")
        assert ls.returncode == 0, ls.stderr
        found = [(re.findall(r"cli/same-[ab]", line), re.findall(r"tc-[0-9a-f]{32}", line))
                 for line in ls.stdout.splitlines()]
        return {keys[0]: ids[0] for keys, ids in found if keys and ids and len(keys) == 1}

    both = rows()
    assert set(both) == {"cli/same-a", "cli/same-b"} and len(set(both.values())) == 1
    r = cli("rm", "cli/same-a")
    assert r.returncode == 0 and "stays" in r.stdout and "still named by cli/same-b" in r.stdout, r.stdout
    assert rows() == {"cli/same-b": both["cli/same-b"]}
    assert cli("get", "cli/same-b", str(tmp_path / "out.npy")).returncode == 0
    assert np.array_equal(np.load(tmp_path / "out.npy"), arr)
    r = cli("rm", "cli/same-b")
    assert r.returncode == 0 and f"deleted cli/same-b ({both['cli/same-b']})" in r.stdout, r.stdout
    assert rows() == {}


def test_an_error_message_is_printed_as_text_not_markup(cli: Any, tmp_path: Path) -> None:
    # "[/x]" once made rich raise MarkupError (a traceback) and "[trace ...]" vanished as an unknown style.
    cli.assert_one_line_error(cli("get", "cli/[/x] [bold]", str(tmp_path / "o.npy")), "NOT_FOUND", "cli/[/x] [bold]")


def _npy_with_objects(path: Path) -> None:
    np.save(path, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)


def _truncated_npy(path: Path) -> None:
    np.save(path, np.arange(1000))
    path.write_bytes(path.read_bytes()[:-100])


def _corrupt_safetensors(path: Path) -> None:
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")


def _truncated_safetensors(path: Path) -> None:
    save_file({"w": np.ones((64, 64), np.float32)}, str(path))
    path.write_bytes(path.read_bytes()[:-1000])


@pytest.mark.parametrize(("name", "make", "says"), [
    ("objects.npy", _npy_with_objects, "Python objects"),
    ("truncated.npy", _truncated_npy, "truncated"),
    ("garbage.npy", lambda p: p.write_bytes(b"not an npy file"), "not a readable .npy file"),
    ("corrupt.safetensors", _corrupt_safetensors, "not a readable safetensors file"),
    ("truncated.safetensors", _truncated_safetensors, "not a readable safetensors file"),
])
def test_put_of_a_bad_file_is_a_one_line_error(cli: Any, tmp_path: Path, name: str,
                                               make: Callable[[Path], None], says: str) -> None:
    make(tmp_path / name)
    cli.assert_one_line_error(cli("put", str(tmp_path / name), "cli/bad"), "INVALID_ARGUMENT", name, says)


def test_get_into_a_missing_or_read_only_directory_is_a_one_line_error(cli: Any, client: tc.Client,
                                                                       tmp_path: Path) -> None:
    client.put(np.arange(4), key="cli/out")
    missing = tmp_path / "no-such-dir" / "out.npy"
    cli.assert_one_line_error(cli("get", "cli/out", str(missing)), "INVALID_ARGUMENT", str(missing), "does not exist")
    # root ignores permission bits, and sysfs refuses new files even to root.
    read_only = Path("/sys") if os.geteuid() == 0 else tmp_path / "read-only"
    if os.geteuid() != 0:
        read_only.mkdir()
        read_only.chmod(0o555)
    r = cli("get", "cli/out", str(read_only / "out.npy"))
    cli.assert_one_line_error(r, "INVALID_ARGUMENT", str(read_only / "out.npy"), "cannot write")
    cli.assert_one_line_error(cli("get", "cli/out", str(tmp_path / "out.txt")), "INVALID_ARGUMENT", "out.txt")


def test_safetensors_metadata_survives_put_and_get(cli: Any, client: tc.Client, tmp_path: Path) -> None:
    meta = {"format": "pt", "note": "[kept] as is"}
    save_file({"w": np.ones(3, np.float32)}, str(tmp_path / "a.safetensors"), metadata=meta)
    save_file({"w": np.zeros(3, np.float32)}, str(tmp_path / "b.safetensors"), metadata=meta)
    for key, src in (("cli/meta-a", "a"), ("cli/meta-b", "b")):
        r = cli("put", str(tmp_path / f"{src}.safetensors"), key)
        assert r.returncode == 0 and "with safetensors metadata" in r.stdout, r.stderr

    def metadata_of(key: str) -> dict[str, str] | None:
        out = tmp_path / f"{key.replace('/', '_')}.safetensors"
        assert cli("get", key, str(out)).returncode == 0
        with safe_open(str(out), "np") as f:
            return f.metadata()

    assert metadata_of("cli/meta-a") == meta
    # Equal metadata under two keys stays two companions: removing one key keeps the other's.
    assert cli("rm", "cli/meta-a").returncode == 0
    assert client.ls("cli/meta-a") == [] and metadata_of("cli/meta-b") == meta
    # A new file without metadata under the same key drops the old metadata.
    save_file({"w": np.zeros(3, np.float32)}, str(tmp_path / "plain.safetensors"))
    assert cli("put", str(tmp_path / "plain.safetensors"), "cli/meta-b").returncode == 0
    assert metadata_of("cli/meta-b") is None
    cli.assert_one_line_error(cli("put", str(tmp_path / "a.safetensors"), "x.__metadata__"), "INVALID_ARGUMENT")


def test_put_policy_is_the_placement_preset(cli: Any, client: tc.Client, tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.arange(7))
    assert cli("put", str(tmp_path / "a.npy"), "cli/durable", "--policy", "durable").returncode == 0
    assert client.artifact("cli/durable").info.policy == "durable"
    bad = cli("put", str(tmp_path / "a.npy"), "cli/x", "--policy", "forever")
    assert bad.returncode == 2 and "'forever' is not one of" in bad.stderr


def test_token_from_option_or_environment(cli_anywhere: Any, tmp_path: Path) -> None:
    with running_cluster(workers=1, token="s3cret") as cluster:
        addr = ["--address", cluster.address]
        no_token = cli_anywhere("status", *addr, env={"TENSORCAST_TOKEN": None})
        cli_anywhere.assert_one_line_error(no_token, "UNAUTHENTICATED")
        assert cli_anywhere("status", *addr, "--token", "s3cret").returncode == 0
        np.save(tmp_path / "a.npy", np.arange(3))
        r = cli_anywhere("put", str(tmp_path / "a.npy"), "cli/t", *addr, env={"TENSORCAST_TOKEN": "s3cret"})
        assert r.returncode == 0, r.stderr
        for command in (["get", "cli/t", str(tmp_path / "o.npy")], ["ls"], ["rm", "cli/t"]):
            assert cli_anywhere(*command, *addr, "--token", "s3cret").returncode == 0, command


def test_large_files_show_progress_in_binary_units(cli: Any, tmp_path: Path) -> None:
    big = np.arange(65 * 2**20 // 8, dtype=np.float64)  # just above the 64 MiB progress threshold
    np.save(tmp_path / "big.npy", big)
    r = cli("put", str(tmp_path / "big.npy"), "cli/big")
    assert r.returncode == 0 and "(1 tensors, 65.0 MiB)" in r.stdout, r.stderr
    assert "reading big.npy" in r.stderr and "uploading" in r.stderr and "65.0 MiB / 65.0 MiB" in r.stderr
    r = cli("get", "cli/big", str(tmp_path / "out.npy"))
    assert r.returncode == 0 and "downloading cli/big" in r.stderr, r.stderr
    assert np.array_equal(np.load(tmp_path / "out.npy", mmap_mode="r"), big)
    assert not re.search(r"\d (kB|MB|GB)\b", r.stderr + r.stdout)
    assert cli("rm", "cli/big").returncode == 0


def test_sizes_are_binary_units_with_one_decimal() -> None:
    cases = {0: "0 B", 1023: "1023 B", 1024: "1.0 KiB", 1536: "1.5 KiB", 2**20 - 1: "1.0 MiB",
             3 * 2**30: "3.0 GiB", 5 * 2**40: "5.0 TiB", 3 * 2**50: "3072.0 TiB"}
    assert {n: size(n) for n in cases} == cases


def test_load_registers_a_checkpoint_and_warms_it(cli: Any, shared_cluster: LocalCluster, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file as save_torch

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    weights = {"model.layers.0.self_attn.q_proj.weight": torch.randn(64, 32), "model.norm.weight": torch.ones(32)}
    save_torch(weights, str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama"}))
    r = cli("load", str(ckpt), "cli/ckpt", "--warm", "w1", "--tp", "1/2")
    assert r.returncode == 0, r.stderr
    assert "registered, not read" in r.stdout and "warm on w1" in r.stdout
    assert "reading into w1" in r.stderr and "KiB" in r.stderr and not re.search(r"\d (kB|MB)\b", r.stderr)
    cli.assert_one_line_error(cli("load", str(tmp_path), "cli/bad"), "NOT_FOUND")


def test_up_refuses_bad_configuration_before_starting_anything(cli_anywhere: Any, tmp_path: Path) -> None:
    from tensorcast.testing.tools import unused_port

    dead = f"http://127.0.0.1:{unused_port()}"  # nothing listens there
    r = cli_anywhere("up", "--etcd", dead, "--data-dir", str(tmp_path / "d"), timeout=20)
    cli_anywhere.assert_one_line_error(r, "UNAVAILABLE", "etcd", dead.removeprefix("http://"))
    r = cli_anywhere("up", "--global-stores", "2", "--data-dir", str(tmp_path / "d"), timeout=20)
    cli_anywhere.assert_one_line_error(r, "INVALID_ARGUMENT", "--etcd")
    (tmp_path / "bad.toml").write_text("[worker]\nmemory_capacity = 'lots'\n")
    r = cli_anywhere("up", "--config", str(tmp_path / "bad.toml"), "--data-dir", str(tmp_path / "d"), timeout=20)
    cli_anywhere.assert_one_line_error(r, "INVALID_ARGUMENT", "worker.memory_capacity")
    assert not (tmp_path / "d" / "logs").exists()  # no process was started


def test_piped_tables_keep_whole_cells(cli: Any, client: tc.Client) -> None:
    key = "cli/" + "a-long-key-name-" * 8  # wider than the 80 columns rich assumes without a terminal
    client.put(np.arange(3), key=key)
    assert key in cli("ls", "cli/", env={"COLUMNS": None}).stdout


def test_load_warm_on_an_unknown_worker_is_a_one_line_error_before_registering(cli: Any, client: tc.Client,
                                                                                tmp_path: Path) -> None:
    save_file({"w": np.ones(4, np.float32)}, str(tmp_path / "c.safetensors"))
    r = cli("load", str(tmp_path / "c.safetensors"), "cli/warm-typo", "--warm", "w9")
    cli.assert_one_line_error(r, "INVALID_ARGUMENT", "--warm w9", "no such worker", "w0, w1")
    assert client.ls("cli/warm-typo") == []  # nothing registered


def _fp8_safetensors(path: Path, values: np.ndarray) -> None:
    """A safetensors file of one F8_E4M3 tensor, written by hand (numpy has no float8 dtype)."""
    header = json.dumps({"w": {"dtype": "F8_E4M3", "shape": list(values.shape),
                               "data_offsets": [0, values.nbytes]}, "__metadata__": {"q": "fp8"}}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + values.tobytes())


def test_put_and_get_of_an_fp8_safetensors_file(cli: Any, client: tc.Client, tmp_path: Path) -> None:
    import ml_dtypes

    values = np.linspace(-4, 4, 48, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn).reshape(6, 8)
    _fp8_safetensors(tmp_path / "fp8.safetensors", values)
    r = cli("put", str(tmp_path / "fp8.safetensors"), "cli/fp8")
    assert r.returncode == 0 and "(1 tensors, 48 B, with safetensors metadata)" in r.stdout, r.stderr
    art = client.artifact("cli/fp8")
    assert art.meta("w").dtype == "float8_e4m3fn" and art.meta("w").shape == (6, 8)
    assert art.tensor("w", like="numpy").tobytes() == values.tobytes()
    assert cli("get", "cli/fp8", str(tmp_path / "out.safetensors")).returncode == 0
    assert (tmp_path / "out.safetensors").read_bytes()[-48:] == values.tobytes()
    with safe_open(str(tmp_path / "out.safetensors"), "np") as f:
        assert f.metadata() == {"q": "fp8"}


def test_an_address_that_does_not_answer_says_where_it_came_from(cli_anywhere: Any, tmp_path: Path) -> None:
    from tensorcast.testing.tools import unused_port

    dead = f"127.0.0.1:{unused_port()}"
    r = cli_anywhere("ls", env={"TENSORCAST_ADDRESS": dead})
    cli_anywhere.assert_one_line_error(r, "UNAVAILABLE", dead, "from TENSORCAST_ADDRESS")
    (tmp_path / "cluster.json").write_text(json.dumps({"address": dead}))
    r = cli_anywhere("status", "--data-dir", str(tmp_path), env={"TENSORCAST_ADDRESS": None})
    cli_anywhere.assert_one_line_error(r, "UNAVAILABLE", dead, f"from {tmp_path / 'cluster.json'}", "still running")
    r = cli_anywhere("ls", "--address", dead)
    cli_anywhere.assert_one_line_error(r, "UNAVAILABLE", dead, "from --address")


def test_status_shows_the_pre_faulted_memory_a_worker_holds(cli: Any, shared_cluster: LocalCluster) -> None:
    """512 MiB pre-faulted per worker by default: `0 B / 1.0 GiB` hid it."""
    deadline = time.monotonic() + 30  # the stock is built once the worker has been idle a while
    while not re.search(r"\bw\d\b.* used \(\d+\.\d MiB pre-faulted\) / 1\.0 GiB", (out := cli("status").stdout)):
        assert time.monotonic() < deadline, out
        time.sleep(0.5)
    assert memory_cell(0, 512 << 20, 4 << 30) == "0 B used (512.0 MiB pre-faulted) / 4.0 GiB"
    assert memory_cell(3 << 20, 0, 4 << 30) == "3.0 MiB used / 4.0 GiB"


def test_the_data_plane_port_is_configurable(tmp_path: Path) -> None:
    from tensorcast.testing.tools import unused_ports

    base = unused_ports(2)
    with running_cluster(workers=2, config={"worker.data_port": base, "worker.prefault_bytes": 0}) as cluster, \
            tc.connect(cluster.address) as client:
        ports = {w.worker_id: int(w.data_address.rsplit(":", 1)[1]) for w in client.list_workers()}
        assert ports == {"w0": base, "w1": base + 1}  # LocalCluster: each worker the next port
        x = np.arange(1 << 16, dtype=np.float32)
        art = client.put({"x": x}, key="cli/dataport", on="w0")
        art.prefetch(to="w1").result(timeout=60)  # a worker-to-worker pull over that port
        assert "w1" in {r.worker_id for r in client.artifact("cli/dataport").replicas}
