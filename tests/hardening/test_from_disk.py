"""from_disk against real workers: only files under the allowed roots, only regular files, no contents in
errors, and a registered file changed or truncated under a reader is refused without taking the worker down."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

import tensorcast as tc
from tensorcast.cluster import LocalCluster
from tensorcast.errors import InvalidArgument, NotFound, PermissionDenied
from tensorcast.testing import running_cluster
from tensorcast.views import TP

ROWS, COLS = 256, 512  # float32: 512 KiB; a dim-1 slice is half of every row (not one byte range)
REMOTE = tc.Config.from_flat({"client.host_id": "elsewhere"})  # bytes through the worker, not a mapping here


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("from-disk")
    models, outside = base / "models", base / "outside"
    models.mkdir()
    outside.mkdir()
    return models.resolve(), outside.resolve()


@pytest.fixture(scope="module")
def cluster(roots: tuple[Path, Path]) -> Iterator[LocalCluster]:
    with running_cluster(workers=1, memory_capacity="256MiB",
                         config={"weights.allowed_roots": str(roots[0])}) as c:
        yield c


def _weights(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.random((ROWS, COLS), dtype=np.float32), "b": rng.random(COLS, dtype=np.float32)}


def _checkpoint(where: Path, seed: int = 0) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    safetensors.numpy.save_file(_weights(seed), str(where / "model.safetensors"))
    return where


def _still_serves(client: tc.Client, cluster: LocalCluster) -> None:
    assert cluster.workers["w0"].popen is not None and cluster.workers["w0"].popen.poll() is None
    x = np.arange(1000, dtype=np.float32)
    art = client.put({"x": x})
    assert np.array_equal(client.artifact(art.id).tensor_dict(like="numpy")["x"], x)


def test_paths_outside_the_roots_are_refused_before_a_byte_is_read(cluster: LocalCluster,
                                                                   roots: tuple[Path, Path]) -> None:
    models, outside = roots
    theirs = _checkpoint(outside / "theirs")
    (models / "link").symlink_to(theirs)  # a symlink out of the root
    escape = models / "escape"
    escape.mkdir()
    (escape / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"w": "../../outside/theirs/model.safetensors"}}))  # an index naming a file outside
    with tc.connect(cluster.address) as client:
        for path in ("/etc/passwd", "/proc/self/environ", theirs, models / "link", models / "link/model.safetensors",
                     escape):
            with pytest.raises(PermissionDenied) as e:
                client.from_disk(path)
            assert "allowed_roots" in e.value.message and "root:x" not in e.value.message, path
        with pytest.raises(NotFound):
            client.from_disk(models / "nothing-here")
        art = client.from_disk(_checkpoint(models / "ours"))  # inside: registered
        assert np.array_equal(art.tensor_dict(like="numpy")["w"], _weights(0)["w"])
        _still_serves(client, cluster)


def test_a_fifo_or_device_is_refused_at_once(cluster: LocalCluster, roots: tuple[Path, Path]) -> None:
    models, _ = roots
    trap = models / "trap"
    trap.mkdir()
    os.mkfifo(trap / "model.safetensors")  # nobody ever writes to it: a blocking open would park a thread
    (models / "dev").mkdir()
    (models / "dev" / "model.safetensors").symlink_to("/dev/zero")  # resolves outside the root
    with tc.connect(cluster.address) as client:
        for _ in range(8):  # more than the worker has threads for: none of them stays parked
            with pytest.raises(InvalidArgument, match=r"not a regular file|cannot be opened"):
                client.from_disk(trap, timeout=10)
        with pytest.raises(PermissionDenied):
            client.from_disk(models / "dev", timeout=10)
        _still_serves(client, cluster)


RULES = {"w": 1, "*": "replicated"}  # "w" cut along its rows' second half: not one byte range


def test_a_rewritten_file_is_refused_not_served(cluster: LocalCluster, roots: tuple[Path, Path]) -> None:
    ckpt = _checkpoint(roots[0] / "rewritten")
    file = ckpt / "model.safetensors"
    with tc.connect(cluster.address) as client, tc.connect(cluster.address, config=REMOTE) as remote:
        art = client.from_disk(ckpt)
        data = bytearray(file.read_bytes())
        data[-COLS * 4 :] = bytes(COLS * 4)  # other bytes, same size: the header still parses
        file.write_bytes(bytes(data))
        with pytest.raises(InvalidArgument, match="changed"):
            remote.artifact(art.id).view(tp=TP(1, 2), rules=RULES).tensor_dict(like="numpy")
        with pytest.raises(InvalidArgument, match="changed"):
            art.prefetch(to="w0", tp=TP(1, 2), rules=RULES).result(timeout=60)
        _still_serves(client, cluster)
        again = client.from_disk(ckpt)  # registered again: what is there now
        assert again.id != art.id
        now, got = safetensors.numpy.load_file(str(file)), remote.artifact(again.id).tensor_dict(like="numpy")
        assert all(np.array_equal(got[k], now[k]) for k in now) and not np.array_equal(now["w"], _weights(0)["w"])


def test_a_truncated_file_is_an_error_not_a_dead_worker(cluster: LocalCluster, roots: tuple[Path, Path]) -> None:
    ckpt = _checkpoint(roots[0] / "truncated")
    file = ckpt / "model.safetensors"
    with tc.connect(cluster.address) as client, tc.connect(cluster.address, config=REMOTE) as remote:
        # verify_checksums=False: no check against the registration before a read, so the bytes are read
        # from a file that is now shorter. Read once first: a worker that mapped the file keeps the mapping,
        # and touching it past the new end would kill the worker (SIGBUS).
        art = client.from_disk(ckpt, verify_checksums=False)
        want = np.array_split(_weights(0)["w"], 2, 1)[1]
        assert np.array_equal(remote.artifact(art.id).view(tp=TP(1, 2), rules=RULES).tensor_dict(like="numpy")["w"],
                              want)
        os.truncate(file, file.stat().st_size // 2)
        with pytest.raises(InvalidArgument, match=r"truncated|short read|changed"):
            remote.artifact(art.id).view(tp=TP(1, 2), rules=RULES).tensor_dict(like="numpy")
        with pytest.raises(InvalidArgument, match=r"truncated|short read|changed"):
            art.prefetch(to="w0", tp=TP(0, 2), rules=RULES).result(timeout=60)
        _still_serves(client, cluster)


def test_remote_reads_of_a_file_in_place_are_exact(cluster: LocalCluster, roots: tuple[Path, Path]) -> None:
    """Read by range and by slice out of the file (no mapping): whole tensors over several ranges and streams,
    a row-parallel slice, a first-dimension slice."""
    where = roots[0] / "large"
    where.mkdir()
    rng = np.random.default_rng(5)
    tensors = {"big": rng.random((3000, 1100), dtype=np.float32), "small": rng.random(77, dtype=np.float32)}
    safetensors.numpy.save_file(tensors, str(where / "model.safetensors"))  # "big": 12.6 MiB, chunks of 4 MiB
    with tc.connect(cluster.address) as client, tc.connect(cluster.address, config=REMOTE) as remote:
        art = client.from_disk(where)
        got = remote.artifact(art.id).tensor_dict(like="numpy")
        assert all(np.array_equal(got[k], v) for k, v in tensors.items())
        for rank in (0, 1, 2):
            for rules in ({"big": 1, "*": "replicated"}, {"big": 0, "*": "replicated"}):
                part = remote.artifact(art.id).view(tp=TP(rank, 3), rules=rules).tensor_dict(like="numpy")
                want = np.array_split(tensors["big"], 3, next(iter(rules.values())))[rank]
                assert np.array_equal(part["big"], want) and np.array_equal(part["small"], tensors["small"])
