"""``tensorcast.api.store`` (the session SGLang's bundled ``tensorcast`` backend is written against) on a real
local cluster: exact existence masks, allocator and scratch transfers, identity isolation, input errors,
failure and termination. No SGLang needed: these are the session's own guarantees."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tensorcast.api.store import (
    AllocatorTransferOptions,
    ByteArtifactKeyspace,
    ByteArtifactSpec,
    HostMemorySpan,
    RegionArtifactInputError,
    RegionArtifactTransfer,
    RegionBackedArtifactSession,
    RegionBackedArtifactSessionOptions,
    RegionSessionFailedError,
    RegionSessionFailureCode,
    RegionSessionOperationKind,
    RegionSessionTerminatedError,
    ScratchTransferOptions,
)
from tensorcast.cluster import LocalCluster
from tensorcast.testing import running_cluster

PAGE = 4096
KEYSPACE = ByteArtifactKeyspace(namespace="tests", engine="sglang", model_id="Model/A", model_version="r1",
                                layout_id="ff1_pf_f16_p4_mha")


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with running_cluster(workers=2) as c:
        yield c


def options(cluster: LocalCluster, transfer: object = None, **kw: object) -> RegionBackedArtifactSessionOptions:
    return RegionBackedArtifactSessionOptions(daemon_address=cluster.address, session_name="test",
                                              transfer=transfer or AllocatorTransferOptions(), **kw)  # type: ignore[arg-type]


def spec(name: str, keyspace: ByteArtifactKeyspace = KEYSPACE, length: int = PAGE) -> ByteArtifactSpec:
    return ByteArtifactSpec(keyspace=keyspace, engine_key=name.encode().ljust(32, b"\0"), byte_length=length)


def transfers(specs: list[ByteArtifactSpec], root: torch.Tensor) -> list[RegionArtifactTransfer]:
    """Artifact i <-> bytes [i * PAGE, (i + 1) * PAGE) of ``root``."""
    return [RegionArtifactTransfer(artifact=s, span=HostMemorySpan.from_tensor(root, offset_bytes=i * PAGE,
                                                                               byte_length=s.byte_length))
            for i, s in enumerate(specs)]


def content(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 255, n * PAGE, dtype=np.uint8))


def test_allocator_mode_roundtrip_exact_existence_and_isolation(cluster: LocalCluster) -> None:
    with RegionBackedArtifactSession.attach(options(cluster)) as session:
        src = session.allocate_host_tensor((4 * PAGE // 2,), torch.float16, name="src")
        src.view(torch.uint8).copy_(content(4, seed=1))
        stored = [spec(f"page-{i}") for i in range(4)]
        put = session.batch_put_from(transfers(stored, src))
        assert put.success_mask == (True,) * 4 and put.operation_id

        # Exact per-artifact answers, also past the first miss (a prefix count could not say these).
        probe = [stored[0], spec("never-0"), stored[1], stored[2], spec("never-1"), stored[3]]
        assert session.batch_exists(probe).existence_mask == (True, False, True, True, False, True)
        # Identity is every keyspace field and the length: a neighbour's or another length's artifact is a miss.
        other = ByteArtifactKeyspace(namespace="tests", engine="sglang", model_id="Model/A", model_version="r2",
                                     layout_id=KEYSPACE.layout_id)
        assert session.batch_exists([spec("page-0", other), spec("page-0", length=PAGE // 2)]).existence_mask == (
            False, False)

        dst = session.allocate_host_tensor((5 * PAGE,), torch.uint8, name="dst")
        got = session.batch_get_into(transfers([stored[2], spec("never-2"), stored[0], *stored[3:]], dst))
        assert got.success_mask == (True, False, True, True)
        assert torch.equal(dst[:PAGE], src.view(torch.uint8)[2 * PAGE : 3 * PAGE])
        assert torch.equal(dst[2 * PAGE : 3 * PAGE], src.view(torch.uint8)[:PAGE])
        assert torch.equal(dst[3 * PAGE : 4 * PAGE], src.view(torch.uint8)[3 * PAGE :])
        assert int(dst[PAGE : 2 * PAGE].count_nonzero()) == 0  # the miss's span was left alone
        assert session.stats["get_hits"] == 3 and session.stats["puts"] == 4

        # Allocator mode moves only spans of this session's regions; a refused batch leaves it usable.
        foreign = torch.zeros(PAGE, dtype=torch.uint8)
        with pytest.raises(RegionArtifactInputError, match="no region"):
            session.batch_put_from(transfers([spec("foreign")], foreign))
        assert session.batch_exists([spec("foreign")]).existence_mask == (False,)
        assert session.region_of(HostMemorySpan.from_tensor(dst, offset_bytes=PAGE, byte_length=8))


def test_scratch_mode_stages_batches_and_reads_allocator_pages(cluster: LocalCluster) -> None:
    stored = [spec(f"scratch-{i}") for i in range(3)]
    with RegionBackedArtifactSession.attach(options(cluster)) as writer:
        root = writer.allocate_host_tensor((3 * PAGE,), torch.uint8, name="w")
        root.copy_(content(3, seed=2))
        assert writer.batch_put_from(transfers(stored, root)).success_mask == (True,) * 3

    with RegionBackedArtifactSession.attach(options(cluster, ScratchTransferOptions(capacity_bytes=3 * PAGE))) as s:
        pool = torch.full((4 * PAGE,), 7, dtype=torch.uint8)  # plain memory: scratch mode takes any span
        got = s.batch_get_into(transfers([stored[1], spec("scratch-missing"), stored[0]], pool))
        assert got.success_mask == (True, False, True) and got.copy_elapsed_s >= 0
        assert torch.equal(pool[:PAGE], root[PAGE : 2 * PAGE]) and torch.equal(pool[2 * PAGE : 3 * PAGE], root[:PAGE])
        assert bool((pool[PAGE : 2 * PAGE] == 7).all())  # only whole received pages reach the caller's memory

        pool.copy_(content(4, seed=3))
        assert s.batch_put_from(transfers([spec(f"scratch-new-{i}") for i in range(3)], pool)).success_mask == (
            True,) * 3
        with pytest.raises(RegionArtifactInputError, match="capacity_bytes"):
            s.batch_put_from(transfers([spec(f"too-many-{i}") for i in range(4)], pool))
        back = torch.zeros(PAGE, dtype=torch.uint8)
        assert s.batch_get_into(transfers([spec("scratch-new-2")], back)).success_mask == (True,)
        assert torch.equal(back, pool[2 * PAGE : 3 * PAGE])


def test_failed_attach_and_termination() -> None:
    with socket.socket() as sock:  # a port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    opts = RegionBackedArtifactSessionOptions(daemon_address=f"127.0.0.1:{port}", transfer_timeout_s=2.0)
    with pytest.raises(RegionSessionFailedError) as err:
        RegionBackedArtifactSession.attach(opts)
    assert err.value.failure.operation_kind is RegionSessionOperationKind.ATTACH
    assert err.value.failure.code in (RegionSessionFailureCode.TRANSPORT, RegionSessionFailureCode.TIMEOUT)


def test_cluster_trouble_makes_misses_not_a_failed_session(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TENSORCAST_KV_HANDOVER_TIMEOUT", "1.5")  # how long the client waits for shard homes
    stored = [spec("gone-0"), spec("gone-1")]
    with running_cluster(workers=1) as c:
        session = RegionBackedArtifactSession.attach(options(c, exists_timeout_s=20.0, transfer_timeout_s=2.0))
        root = session.allocate_host_tensor((2 * PAGE,), torch.uint8, name="r")
        assert session.batch_put_from(transfers(stored, root)).success_mask == (True, True)
    try:  # the whole cluster is gone now: a cache recomputes, so these are misses and failed puts
        assert session.batch_exists(stored).existence_mask == (False, False)
        assert session.batch_get_into(transfers(stored, root)).success_mask == (False, False)
        assert session.batch_put_from(transfers([spec("gone-2")], root)).success_mask == (False,)
        assert session.failure is None and session.stats["transient_errors"] >= 1
    finally:
        session.terminate_process_session()


def test_terminated_session_refuses_calls_and_keeps_regions(cluster: LocalCluster) -> None:
    session = RegionBackedArtifactSession.attach(options(cluster))
    region = session.allocate_host_tensor((2, 8), torch.float32, name="kept")
    session.terminate_process_session()
    session.terminate_process_session()  # idempotent
    with pytest.raises(RegionSessionTerminatedError):
        session.batch_exists([spec("x")])
    with pytest.raises(RegionSessionTerminatedError):
        session.allocate_host_tensor((4,), torch.uint8, name="late")
    region.fill_(3.0)  # the memory belongs to the tensor, not to the session
    assert float(region.sum()) == 48.0


def test_values_are_validated() -> None:
    with pytest.raises(RegionArtifactInputError):
        ByteArtifactKeyspace(namespace=" ", engine="e", model_id="m", model_version="v", layout_id="l")
    with pytest.raises(RegionArtifactInputError):
        ByteArtifactSpec(keyspace=KEYSPACE, engine_key=b"", byte_length=8)
    with pytest.raises(RegionArtifactInputError):
        ByteArtifactSpec(keyspace=KEYSPACE, engine_key=b"k", byte_length=0)
    tensor = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(RegionArtifactInputError, match="outside"):
        HostMemorySpan.from_tensor(tensor, offset_bytes=8, byte_length=9)
    with pytest.raises(RegionArtifactInputError, match="contiguous"):
        HostMemorySpan.from_tensor(torch.zeros(4, 4)[:, 1], offset_bytes=0, byte_length=4)
    with pytest.raises(RegionArtifactInputError, match="span holds"):
        RegionArtifactTransfer(artifact=spec("k", length=8),
                               span=HostMemorySpan.from_tensor(tensor, offset_bytes=0, byte_length=4))
    with pytest.raises(RegionArtifactInputError):
        RegionBackedArtifactSessionOptions(daemon_address="127.0.0.1:1", exists_timeout_s=0)
    # Same inputs, same identity; the page key grows with neither the model id nor the namespace.
    long_space = ByteArtifactKeyspace(namespace="n" * 400, engine="sglang", model_id="m" * 400,
                                      model_version="v", layout_id="l")
    assert spec("k", long_space).kv_key == spec("k", long_space).kv_key != spec("k").kv_key
    assert len(spec("k", long_space).kv_key) < 200
    span = HostMemorySpan.from_tensor(tensor, offset_bytes=4, byte_length=4)
    span.view()[:] = 9  # a view of the tensor's own memory
    assert tensor[4:8].tolist() == [9, 9, 9, 9] and int(tensor.sum()) == 36
