"""TensorCast as a Distributed Checkpoint backend, with real trainer processes (spawned, gloo).

One story on one three-worker cluster: four ranks train a small model with Adam, save three checkpoints
(``dcp.save``, ``dcp.async_save``, ``dcp.save`` with ``keep_last=2``), and one rank is killed with SIGKILL;
then a worker holding replicas is killed with SIGKILL too, and restarted jobs of two and three ranks load
the checkpoints into another layout (dim 0 -> dim 1, uneven), and one process loads a full state dict.
"""

from __future__ import annotations

import os
import signal
import socket
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402

import tensorcast as tc  # noqa: E402
from tensorcast.integrations.torch_dcp import (  # noqa: E402
    TensorCastReader,
    TensorCastWriter,
    delete_checkpoint,
    full_state_dict,
    list_checkpoints,
    publish_weights,
)
from tensorcast.integrations.torch_dcp_disk import register_dcp_dir  # noqa: E402
from tensorcast.integrations.torch_dcp_layout import rank_key  # noqa: E402
from tensorcast.testing import running_cluster  # noqa: E402

RUN = "run7/"
TRAIN_STEP = 1200


def _trained() -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The same small model after three Adam steps, in every process: parameters and Adam state by name.
    On one thread: a matmul's summation order follows the thread count (the test process and the spawned
    ranks can differ), and a last-bit difference would read as a resharding bug."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_three_steps()
    finally:
        torch.set_num_threads(threads)


def _train_three_steps() -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.ReLU(), torch.nn.Linear(20, 6))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(32, 12), torch.randn(32, 6)
    for _ in range(3):
        optim.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optim.step()
    names = [n for n, _ in model.named_parameters()]
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {names[i]: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
             for i, s in optim.state_dict()["state"].items()}
    return params, state


def _shard(full: Any, mesh: Any, dim: int) -> Any:
    dim = min(dim, full.dim() - 1)
    world, rank = mesh.size(), mesh.get_local_rank()
    local = full.chunk(world, dim)[rank] if rank < len(full.chunk(world, dim)) else full.narrow(dim, 0, 0)
    return DTensor.from_local(local.contiguous(), mesh, [Shard(dim)], run_check=False, shape=full.shape,
                              stride=full.stride())


def _state_dict(mesh: Any, dim: int, *, empty: bool) -> dict[str, Any]:
    params, state = _trained()

    def prep(t: Any) -> Any:
        return _shard(torch.zeros_like(t) if empty else t, mesh, dim)

    return {"model": {n: prep(p) for n, p in params.items()},
            "optim": {n: {"exp_avg": prep(s["exp_avg"]), "exp_avg_sq": prep(s["exp_avg_sq"]),
                          "step": torch.zeros_like(s["step"]) if empty else s["step"]} for n, s in state.items()},
            "train": {"step": 0 if empty else TRAIN_STEP, "lr": 0.0 if empty else 1e-2}}


def _init(rank: int, world: int, port: int) -> Any:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return init_device_mesh("cpu", (world,))


def _save_job(rank: int, world: int, port: int, address: str) -> None:
    mesh = _init(rank, world, port)
    with tc.connect(address) as client:
        sd = _state_dict(mesh, 0, empty=False)
        dcp.save(sd, storage_writer=TensorCastWriter(client, RUN + "step-1"))
        writer = TensorCastWriter(client, RUN + "step-2")
        pending = dcp.async_save(sd, storage_writer=writer)
        pending.result(timeout=120)
        writer.wait_durable(timeout=120)
        writer = TensorCastWriter(client, RUN + "step-3", keep_last=2)
        dcp.save(sd, storage_writer=writer)
        writer.wait_durable(timeout=120)
    dist.barrier()
    if rank == world - 1:  # a trainer rank dies hard after the checkpoint
        os.kill(os.getpid(), signal.SIGKILL)
    dist.destroy_process_group()


def _save_files_job(rank: int, world: int, port: int, path: str) -> None:
    """DCP's own FileSystemWriter, as a trainer without TensorCast writes a checkpoint."""
    mesh = _init(rank, world, port)
    dcp.save(_state_dict(mesh, 0, empty=False), storage_writer=dcp.FileSystemWriter(path))
    dist.destroy_process_group()


def _load_job(rank: int, world: int, port: int, address: str, key: str) -> None:
    mesh = _init(rank, world, port)
    sd = _state_dict(mesh, 1, empty=True)
    with tc.connect(address) as client:
        dcp.load(sd, storage_reader=TensorCastReader(client, key))
    want = _state_dict(mesh, 1, empty=False)
    assert sd["train"] == want["train"]
    for group in ("model", "optim"):
        for name, value in _flat(want[group]).items():
            got = _flat(sd[group])[name]
            if isinstance(value, DTensor):
                assert got.placements == (Shard(min(1, value.dim() - 1)),)
                got, value = got.to_local(), value.to_local()
            assert got.dtype == value.dtype and got.shape == value.shape, name
            assert got.numpy().tobytes() == value.numpy().tobytes(), f"{name} differs on rank {rank}"
    dist.destroy_process_group()


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(fn: Any, world: int, *args: Any) -> list[int | None]:
    """Run ``fn(rank, world, port, *args)`` in ``world`` spawned processes; their exit codes."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=fn, args=(r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    return codes


def test_save_reshard_recover_and_keep_last() -> None:
    with running_cluster(workers=3, memory_capacity="256MiB") as cluster, tc.connect(cluster.address) as client:
        codes = _launch(_save_job, 4, cluster.address)
        assert codes == [0, 0, 0, -signal.SIGKILL], codes

        # keep_last=2: step-1 went as a whole (manifest and rank artifacts), step-2 and step-3 stay.
        assert [e.key for e in list_checkpoints(client, RUN)] == [RUN + "step-2", RUN + "step-3"]
        assert not client.ls(RUN + "step-1")
        ranks = [client.artifact(rank_key(RUN + "step-3", r)) for r in range(4)]
        # Each rank wrote into a worker of its own host, spread by rank; two memory replicas and a disk copy.
        assert [r.info.replicas[0].worker_id for r in ranks] != [] and all(r.info.replicas_wanted == 2 for r in ranks)
        assert all(r.info.copies == 2 for r in ranks), [r.info.replicas for r in ranks]
        assert all(any(rep.tier == "disk" for rep in r.info.replicas) for r in ranks)

        # A worker holding one of rank 0's memory replicas (not the gateway the jobs connect to) dies hard.
        gateway = {w.address: w.worker_id for w in client.list_workers()}[cluster.address]
        victim = next(r.worker_id for r in ranks[0].info.replicas if r.worker_id != gateway)
        cluster.kill_worker(victim)  # SIGKILL: its memory replicas are gone

        assert _launch(_load_job, 2, cluster.address, RUN + "step-3") == [0, 0]
        assert _launch(_load_job, 3, cluster.address, RUN + "step-2") == [0, 0, 0]

        full = full_state_dict(client, RUN + "step-3")
        params, state = _trained()
        assert full["train"] == {"step": TRAIN_STEP, "lr": 1e-2}
        for name, p in params.items():
            assert np.array_equal(full["model"][name].numpy(), p.numpy())
            assert np.array_equal(full["optim"][name]["exp_avg_sq"].numpy(), state[name]["exp_avg_sq"].numpy())
            assert float(full["optim"][name]["step"]) == float(state[name]["step"])

        delete_checkpoint(client, RUN + "step-2")
        assert not client.ls(RUN + "step-2")


def test_a_dcp_directory_on_disk_registers_in_place_and_loads_resharded(tmp_path: Any) -> None:
    path = tmp_path / "step-5"
    assert _launch(_save_files_job, 2, str(path)) == [0, 0]
    with running_cluster(workers=2, memory_capacity="256MiB") as cluster, tc.connect(cluster.address) as client:
        register_dcp_dir(client, path, "run8/step-5")
        files = client.artifact(rank_key("run8/step-5", 0))
        assert files.info.meta["format"] == "dcp" and files.info.meta["source"] == str(path)
        assert {r.tier for r in files.info.replicas} == {"disk"}  # registered, not read
        assert [e.key for e in list_checkpoints(client, "run8/")] == ["run8/step-5"]
        # Saved by 2 ranks on dim 0, loaded by 3 on dim 1 (uneven): each reads its ranges from the files.
        assert _launch(_load_job, 3, cluster.address, "run8/step-5") == [0, 0, 0]
        full = full_state_dict(client, "run8/step-5")
        params, _state = _trained()
        assert full["train"] == {"step": TRAIN_STEP, "lr": 1e-2}
        for name, p in params.items():
            assert np.array_equal(full["model"][name].numpy(), p.numpy())
        delete_checkpoint(client, "run8/step-5")
        assert not client.ls("run8/")
    assert (path / ".metadata").exists()  # deleting the registration leaves the user's files


def test_a_checkpoint_of_a_hf_model_is_served_as_the_trained_model(tmp_path: Any) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tensorcast.integrations.transformers import load_into

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).loss.backward()
    optim.step()
    state = {"model": model.state_dict(), "step": 1}
    with pytest.warns(UserWarning):  # DCP warns that it saves in one process
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "hf")), no_dist=True)
    with running_cluster(workers=2) as cluster, tc.connect(cluster.address) as client:
        dcp.save(state, storage_writer=TensorCastWriter(client, "hf-run/step-1"), no_dist=True)
        register_dcp_dir(client, tmp_path / "hf", "hf-run/from-disk")
        with torch.no_grad():
            want = model(ids).logits
        for key in ("hf-run/step-1", "hf-run/from-disk"):
            version = publish_weights(client, key, "tiny-llama", prefix="model.")
            served = LlamaForCausalLM(config)  # initialized differently (another seed's draw)
            load_into(client, f"tiny-llama@v{version}", served)
            with torch.no_grad():
                assert torch.equal(served(ids).logits, want), key
