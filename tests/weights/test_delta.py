"""Sparse deltas between weight versions: chunking and records (pure), and a publisher's delta read back by a
rollout engine's reader (``integrations.rollout_delta``) over a real worker: only the changed chunks move,
within 1.2x of the bytes that changed, and they rebuild the new version exactly on top of the old one; a
checksum that does not match, a malformed record, a record from another base, or one that leaves out a tensor
whose digest changed is refused or ignored."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tensorcast.errors import InvalidArgument
from tensorcast.weights.delta import (
    DIGEST_BYTES,
    Chunking,
    Delta,
    changed_chunks,
    chunk_digests,
    chunking,
    delta_between,
    runs,
)


@pytest.mark.parametrize(("shape", "itemsize", "chunk", "want"), [
    ((1000, 64), 4, 4096, Chunking(1000, 256, 16)),  # 16 rows of 256 bytes to a 4 KiB chunk
    ((10,), 2, 4, Chunking(10, 2, 2)),  # a vector: rows are elements
    ((), 4, 1024, Chunking(1, 4, 256)),  # a scalar: one row, one chunk
    ((2, 100000), 4, 1024, Chunking(2, 400000, 1)),  # rows larger than a chunk: a row each
    ((0, 8), 4, 1024, Chunking(0, 0, 1)),  # empty: no chunk
])
def test_chunking_cuts_whole_rows(shape: tuple[int, ...], itemsize: int, chunk: int, want: Chunking) -> None:
    nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
    cut = chunking(shape, nbytes, chunk)
    assert cut == want
    assert sum(cut.nbytes(i, i + 1) for i in range(cut.count)) == nbytes  # the chunks tile the tensor
    with pytest.raises(InvalidArgument):
        chunking(shape, nbytes, 0)


def test_one_changed_element_changes_one_chunk() -> None:
    t = np.random.default_rng(0).standard_normal((1000, 64)).astype(np.float32)
    cut = chunking(t.shape, t.nbytes, 4096)
    before = chunk_digests(t.reshape(-1).view(np.uint8), cut)
    assert len(before) == cut.count * DIGEST_BYTES
    t[500, 3] += 1.0
    t[999, 63] += 1.0  # in the last chunk, which is shorter
    assert changed_chunks(before, chunk_digests(t.reshape(-1).view(np.uint8), cut)) == [500 // 16, 999 // 16]
    assert runs([1, 2, 3, 7, 9, 10]) == [(1, 4), (7, 8), (9, 11)] and runs([]) == []


def _chunks(state: dict[str, np.ndarray], chunk: int = 1024) -> dict[str, tuple]:
    out = {}
    for name, t in state.items():
        cut = chunking(t.shape, t.nbytes, chunk)
        out[name] = (str(t.dtype), t.shape, cut, chunk_digests(t.reshape(-1).view(np.uint8), cut))
    return out


def test_delta_between_only_for_the_same_layout_and_a_small_change() -> None:
    rng = np.random.default_rng(1)
    state = {"a": rng.standard_normal((64, 64)).astype(np.float32), "b": rng.standard_normal(256).astype(np.float32)}
    before = _chunks(state)
    state["a"][10:20] += 1.0  # rows 10..19: chunks 2 to 4 of 4 rows each
    delta = delta_between(7, before, _chunks(state))
    assert delta is not None and delta.base == 7 and list(delta.tensors) == ["a"]
    assert [i for i, _ in delta.tensors["a"][1]] == [2, 3, 4]
    layout = {n: (t.shape, t.nbytes) for n, t in state.items()}
    assert delta.nbytes(layout) == 12 * 256  # 12 rows of 256 bytes for 10 changed
    assert Delta.decode(delta.encode(), layout) == delta
    assert delta_between(7, before, {**_chunks(state), "c": _chunks(state)["b"]}) is None  # another tensor set
    state["b"] = state["b"].reshape(16, 16)
    assert delta_between(7, before, _chunks(state)) is None  # another shape
    state["b"] = state["b"].reshape(256)
    state["a"] += 1.0  # most bytes changed: reading everything is as cheap
    assert delta_between(7, before, _chunks(state)) is None


@pytest.mark.parametrize("doc", [
    b"not json", b"[]", b'{"base": 0, "tensors": {}}', b'{"base": 1}',
    b'{"base": 1, "tensors": {"nope": {"rows": 4, "chunks": [[0, "' + b"0" * 32 + b'"]]}}}',
    b'{"base": 1, "tensors": {"a": {"rows": 4, "chunks": [[16, "' + b"0" * 32 + b'"]]}}}',  # past the end
    b'{"base": 1, "tensors": {"a": {"rows": 0, "chunks": [[0, "' + b"0" * 32 + b'"]]}}}',
    b'{"base": 1, "tensors": {"a": {"rows": 4, "chunks": [[1, "' + b"0" * 32 + b'"], [1, "' + b"0" * 32
    + b'"]]}}}',  # repeated
    b'{"base": 1, "tensors": {"a": {"rows": 4, "chunks": [[0, "short"]]}}}',
    b'{"base": 1, "tensors": {"a": {"rows": 4, "chunks": []}}}',
    b'{"base": 1, "tensors": {"__tensorcast_version__": {"rows": 4, "chunks": [[0, "' + b"0" * 32 + b'"]]}}}',
    b'{"base": 1, "tensors": {"a": {"rows": true, "chunks": [[0, "' + b"0" * 32 + b'"]]}}}',
    b'{"base": 1, "tensors": {"a": {"rows": 4, "chunks": [[1.5, "' + b"0" * 32 + b'"]]}}}',
    b'{"base": 1, "tensors": {"a": {"rows": 4, "chunks": [["1", "' + b"0" * 32 + b'"]]}}}',
    b'{"base": 1, "tensors": {"a": {"rows": 4, "chunks": [[1, "' + b"z" * 32 + b'"]]}}}',  # not hex
    b"[" * 100000 + b"]" * 100000,  # nested deeper than the parser recurses
])
def test_malformed_delta_records_are_typed_errors(doc: bytes) -> None:
    with pytest.raises(InvalidArgument, match="malformed delta record"):
        Delta.decode(np.frombuffer(doc, dtype=np.uint8), {"a": ((64, 64), 64 * 64 * 4),
                                                          "__tensorcast_version__": ((20,), 20)})


def test_a_rollout_reads_only_the_changed_chunks_and_rebuilds_the_version(tmp_path: object) -> None:
    import torch

    import tensorcast as tc
    from tensorcast.integrations.rollout_delta import delta_of, read_changed
    from tensorcast.testing import running_cluster
    from tensorcast.weights.versions import DELTA_TENSOR, version_key

    g = torch.Generator().manual_seed(0)
    state = {"embed": torch.randn(2048, 128, generator=g), "w": torch.randn(512, 128, generator=g),
             "norm": torch.randn(128, generator=g), "scale": torch.tensor(2.0)}
    config = tc.Config.load(overrides={"weights.delta_chunk_bytes": "8KiB"})  # 16 rows of 512 bytes
    with running_cluster(workers=1) as cluster, tc.connect(cluster.address, config=config) as client:
        pub = client.publisher("m")
        first = pub.publish(state)
        assert first.delta_base is None and first.delta_bytes == sum(t.nbytes for t in state.values())
        old = {n: t.clone() for n, t in state.items()}
        state["embed"][100:900] += 0.5  # 800 of 2048 rows, not chunk-aligned
        state["scale"] = torch.tensor(3.0)
        second = pub.publish(state)
        changed = 800 * 512 + 4
        assert second.delta_base == first.version and changed <= second.delta_bytes <= 1.2 * changed

        art = client.artifact(version_key("m", second.version))
        base = client.artifact(version_key("m", first.version)).info
        assert delta_of(art, None, None) is None and delta_of(art, first.version, None) is None  # base unknown
        assert delta_of(art, second.version, art.info) is None  # not a delta from that version
        delta = delta_of(art, first.version, base)
        assert delta is not None
        rows, moved = read_changed(art, delta)
        assert moved == second.delta_bytes
        rebuilt = {n: t.clone() for n, t in old.items()}
        for r in rows:
            target = rebuilt[r.name]
            if target.dim() == 0:
                target.copy_(r.rows)
            else:
                target[r.first_row:r.first_row + len(r.rows)] = r.rows
        assert all(torch.equal(rebuilt[n], state[n]) for n in state)

        # A checksum that does not match what was read: refused, naming the chunk.
        name, (per_chunk, chunks) = next(iter(delta.tensors.items()))
        forged = Delta(delta.base, {name: (per_chunk, ((chunks[0][0], "0" * 32),))})
        with pytest.raises(InvalidArgument, match="checksum"):
            read_changed(art, forged)

        # A version whose delta record is malformed: read as a whole version (delta_of says None).
        bad = np.frombuffer(json.dumps({"base": first.version, "tensors": {"w": {"rows": 0}}}).encode(), np.uint8)
        client.put({**state, DELTA_TENSOR: bad}, key="m-bad")
        assert delta_of(client.artifact("m-bad"), first.version, base) is None
        # A well-formed record that leaves out a tensor that changed ("scale"): inconsistent with the base's
        # digests, so not trusted (old bytes would keep serving).
        partial = Delta(first.version, {"embed": delta.tensors["embed"]})
        client.put({**state, DELTA_TENSOR: partial.encode()}, key="m-partial")
        assert delta_of(client.artifact("m-partial"), first.version, base) is None
        client.put({**state, "scale": old["scale"], DELTA_TENSOR: partial.encode()}, key="m-consistent")
        assert delta_of(client.artifact("m-consistent"), first.version, base) == partial

        # A publish after most bytes changed carries no record.
        third = pub.publish({n: t + 1.0 for n, t in state.items()})
        assert third.delta_base is None
        assert DELTA_TENSOR not in client.artifact(version_key("m", third.version)).tensor_names


def test_layers_a_delta_touches() -> None:
    from tensorcast.integrations.rollout_delta import layer_of, touched_layers

    assert layer_of("model.layers.3.mlp.experts.7.up_proj.weight") == "model.layers.3"  # a whole decoder layer
    assert layer_of("model.norm.weight") == "model.norm" and layer_of("lm_head.weight") == "lm_head"
    assert layer_of("scale") == "scale"
    names = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.layers.0.input_norm.weight",
             "model.layers.1.mlp.up_proj.weight", "model.layers.10.mlp.up_proj.weight", "model.norm.weight"]
    assert touched_layers(["model.layers.1.mlp.up_proj.weight"], names) == ["model.layers.1.mlp.up_proj.weight"]
    assert touched_layers(["model.layers.0.mlp.up_proj.weight", "model.norm.weight"], names) == [
        "model.layers.0.input_norm.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"]


@pytest.mark.parametrize("value", [0, -1, "0B"])
def test_a_chunk_size_below_one_byte_is_refused_when_the_config_loads(value: object) -> None:
    import tensorcast as tc

    with pytest.raises(InvalidArgument, match="delta_chunk_bytes"):
        tc.Config.from_flat({"weights.delta_chunk_bytes": value})
    assert tc.Config.from_flat({"weights.delta_chunk_bytes": "64KiB"}).weights.delta_chunk_bytes == 65536
