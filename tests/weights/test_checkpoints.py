"""Safetensors checkpoints through TensorCast: every TP rank's slices byte-exact against safetensors + torch,
warm and cold paths, transformers logits, and clear errors for broken files."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tensorcast as tc
from tensorcast.cluster import LocalCluster
from tensorcast.errors import InvalidArgument
from tensorcast.views import TP
from tensorcast.weights import open_checkpoint, rules_for

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
ROW = ("o_proj", "down_proj")


def expected_shard(name: str, full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """What a rank must get, computed independently of TensorCast with torch.chunk."""
    dim = 0 if any(p in name for p in COLUMN) and "norm" not in name else 1 if any(p in name for p in ROW) else None
    if dim is None or full.dim() == 0:
        return full
    chunks = torch.chunk(full, world, dim=dim)
    return chunks[rank] if rank < len(chunks) else full.narrow(dim, 0, 0)


def make_checkpoint(root: Path, family: str, dtype: torch.dtype, sharded: bool) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=300, hidden_size=96, intermediate_size=200, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(hash((family, str(dtype), sharded)) % 1000)
    model = LlamaForCausalLM(LlamaConfig(**common)) if family == "llama" else Qwen2ForCausalLM(Qwen2Config(**common))
    path = root / f"{family}-{str(dtype).split('.')[-1]}-{'sharded' if sharded else 'single'}"
    model.to(dtype).save_pretrained(path, max_shard_size="100KB" if sharded else "10GB")
    return path


CASES = [("llama", torch.bfloat16, True), ("llama", torch.float16, False), ("qwen2", torch.bfloat16, False),
         ("qwen2", torch.float16, True)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, torch.dtype, bool], Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {c: make_checkpoint(root, *c) for c in CASES}


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    from tensorcast.testing import running_cluster

    with running_cluster(workers=2, hosts=2) as c:
        yield c


def reference(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{str(c[1]).split('.')[-1]}-{'sh' if c[2] else 'one'}")
def test_every_rank_matches_safetensors_and_reassembles(cluster: LocalCluster, checkpoints: dict, case: tuple) -> None:
    path = checkpoints[case]
    ref = reference(path)
    assert (path / "model.safetensors.index.json").exists() == case[2]
    remote_cfg = tc.Config.from_flat({"client.host_id": "elsewhere"})
    with tc.connect(cluster.address) as local, tc.connect(cluster.address, config=remote_cfg) as remote:
        art = local.from_disk(path, key=f"ckpt/{path.name}")
        assert art.info.meta["model_type"] == case[0] and set(art.tensor_names) == set(ref)
        for world in (1, 2, 4):
            parts: dict[str, list[torch.Tensor]] = {k: [] for k in ref}
            for rank in range(world):
                reader = local if rank % 2 == 0 else remote  # same-host mapping and network path
                got = reader.artifact(art.id).view(tp=TP(rank, world)).tensor_dict()
                for name, full in ref.items():
                    want = expected_shard(name, full, rank, world)
                    assert got[name].dtype == full.dtype and torch.equal(got[name], want), (name, rank, world)
                    parts[name].append(got[name])
            for name, full in ref.items():
                dim = 0 if any(p in name for p in COLUMN) else 1 if any(p in name for p in ROW) else None
                if dim is not None:
                    assert torch.equal(torch.cat(parts[name], dim), full)


def test_warm_path_materializes_a_rank_and_maps_it(cluster: LocalCluster, checkpoints: dict) -> None:
    path = checkpoints[CASES[0]]
    ref = reference(path)
    with tc.connect(cluster.address) as c:
        art = c.from_disk(path)
        res = art.prefetch(to="w0", tp=TP(1, 2)).result(timeout=60)
        assert not res.already_present and res.source == "w0"  # read in place from the checkpoint files
        assert art.prefetch(to="w0", tp=TP(1, 2)).result(timeout=60).already_present
        view = c.artifact(art.id).view(tp=TP(1, 2))
        got = view.tensor_dict()
        d = view.last_diagnostics
        assert d is not None and d.replica == "w0" and d.tier == "memory" and d.transport == "shared-memory"
        for name, full in ref.items():
            assert torch.equal(got[name], expected_shard(name, full, 1, 2))
        # Another worker (another host) materializes its rank by fetching only the slices.
        res = art.prefetch(to="w1", tp=TP(0, 2)).result(timeout=60)
        assert res.source == "w0" and res.bytes_moved < art.nbytes


def test_transformers_model_from_tensorcast_has_identical_logits(cluster: LocalCluster, checkpoints: dict) -> None:
    from transformers import AutoModelForCausalLM

    from tensorcast.integrations.transformers import from_tensorcast, load_into

    for case in (CASES[0], CASES[2]):
        path = checkpoints[case]
        with tc.connect(cluster.address) as c:
            c.from_disk(path, key=f"hf/{path.name}")
            ours = from_tensorcast(c, f"hf/{path.name}")
            theirs = AutoModelForCausalLM.from_pretrained(path)
            ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
            with torch.no_grad():
                assert torch.equal(ours(ids).logits, theirs(ids).logits)
            # In place into an existing (differently initialized) model.
            other = AutoModelForCausalLM.from_config(theirs.config, dtype=theirs.dtype)
            ptr = other.model.embed_tokens.weight.data_ptr()
            load_into(c, f"hf/{path.name}", other)
            assert other.model.embed_tokens.weight.data_ptr() == ptr  # filled in place
            with torch.no_grad():
                assert torch.equal(other(ids).logits, theirs(ids).logits)


def test_broken_checkpoints_give_clear_errors(cluster: LocalCluster, tmp_path: Path, checkpoints: dict) -> None:
    src = checkpoints[CASES[1]] / "model.safetensors"
    data = src.read_bytes()
    (hlen,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + hlen])
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    truncated = tmp_path / "truncated" / "model.safetensors"
    truncated.parent.mkdir()
    truncated.write_bytes(data[:-10])
    corrupt = tmp_path / "corrupt" / "model.safetensors"
    corrupt.parent.mkdir()
    corrupt.write_bytes(data[:9] + b"\x00\xff" + data[11:])  # garbage inside the JSON header
    with tc.connect(cluster.address) as c:
        with pytest.raises(InvalidArgument) as e:
            c.from_disk(truncated.parent)
        assert str(truncated) in e.value.message and last in e.value.message and "truncated" in e.value.message
        with pytest.raises(InvalidArgument, match="corrupted safetensors header") as e2:
            c.from_disk(corrupt.parent)
        assert str(corrupt) in e2.value.message
        with pytest.raises(tc.errors.NotFound):
            c.from_disk(tmp_path / "nope")
        # A registered file that changes afterwards is refused, naming the file and tensor.
        victim = tmp_path / "victim"
        victim.mkdir()
        (victim / "model.safetensors").write_bytes(data)
        art = c.from_disk(victim)
        (victim / "model.safetensors").write_bytes(data[:-10])
        with pytest.raises(InvalidArgument, match="changed since it was registered"):
            art.tensor_dict()


def test_rules_by_model_type_fused_and_moe() -> None:
    llama = rules_for("llama")
    assert llama.spec_for("model.layers.3.self_attn.k_proj.weight") == 0
    assert llama.spec_for("model.layers.3.mlp.down_proj.weight") == 1
    assert llama.spec_for("model.norm.weight") == "replicated"
    moe = rules_for("qwen3_moe")
    assert moe.spec_for("model.layers.0.mlp.experts.7.gate_proj.weight") == 0
    assert moe.spec_for("model.layers.0.mlp.experts.7.down_proj.weight") == 1
    assert moe.spec_for("model.layers.0.mlp.gate.weight") == "replicated"
    cfg = {"num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 64}
    fused = rules_for("llama", cfg)
    q, k = 8 * 8, 2 * 8
    qkv = torch.arange((q + 2 * k) * 4, dtype=torch.float32).reshape(q + 2 * k, 4)
    import numpy as np

    from tensorcast.views import apply_slices

    for rank in range(2):
        (spec,) = fused.slices("model.layers.0.self_attn.qkv_proj.weight", tuple(qkv.shape), TP(rank, 2))
        got = torch.from_numpy(apply_slices(qkv.numpy(), (spec,)).copy())
        parts = torch.split(qkv, [q, k, k])
        want = torch.cat([p.chunk(2, 0)[rank] for p in parts])
        assert torch.equal(got, want)
    gate_up = torch.arange(40.0).reshape(10, 4)
    (spec,) = fused.slices("model.layers.0.mlp.gate_up_proj.weight", (10, 4), TP(1, 2))
    want = torch.cat([p.chunk(2, 0)[1] for p in gate_up.chunk(2, 0)])
    assert torch.equal(torch.from_numpy(np.ascontiguousarray(apply_slices(gate_up.numpy(), (spec,)))), want)
    with pytest.raises(InvalidArgument, match="no tensor-parallel rules"):
        rules_for("gpt-j")
    ckpt_dir = Path(__file__).parent
    with pytest.raises(tc.errors.NotFound):
        open_checkpoint(ckpt_dir / "missing")
