"""Same-host content poisoning, against real worker processes: a token holder on the host states the digest of
X for bytes it did not write (or states wrong digests at a digests-later commit), and an honest client that
then puts X reads X, whichever worker it reads from and by whichever path (a mapping, or the data plane)."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest

import tensorcast as tc
from tensorcast.cluster import LocalCluster
from tensorcast.errors import NotFound, Unavailable
from tensorcast.records import ArtifactInfo, TensorMeta
from tensorcast.tensors import digest_bytes
from tensorcast.testing import running_cluster
from tensorcast.testing.raw import RawPeer
from tensorcast.wire.messages import ErrorReply, PutBegin, PutCommit, PutDone, PutPlan

MiB = 1 << 20


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with running_cluster(workers=2, memory_capacity="256MiB") as c:
        yield c


@pytest.fixture(scope="module")
def remote(cluster: LocalCluster) -> Iterator[tc.Client]:
    """A client that reads over the data plane (it says it is on another host)."""
    with tc.connect(cluster.address, config=tc.Config.from_flat({"client.host_id": "elsewhere"})) as c:
        yield c


def lie(address: str, x: np.ndarray, *, later: bool = False) -> ArtifactInfo:
    """A same-host put that states X's digest and writes nothing into the segments it is given (zeros stay):
    with ``later``, begun with digests_later and X's digest stated at the commit."""
    digest = digest_bytes(x)
    meta = TensorMeta(name="tensor", dtype="uint8", shape=(x.nbytes,), nbytes=x.nbytes, digest="" if later else digest)
    peer = RawPeer(address)
    try:
        peer.hello()
        peer.send(PutBegin(tensors=(meta,), same_host=True, digests_later=later), request_id=2)
        plan = peer.recv()[1]
        assert isinstance(plan, PutPlan) and not plan.digests_first, plan
        peer.send(PutCommit(put_id=plan.put_id, digests=(digest,) if later else ()), request_id=3)
        done = peer.recv()[1]
        assert not isinstance(done, ErrorReply), done
        assert isinstance(done, PutDone)
        return done.artifact
    finally:
        peer.close()


def mismatches(cluster: LocalCluster, worker: str) -> float:
    with urllib.request.urlopen(cluster.metrics_urls[worker] + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(
        r'^tensorcast_blob_verifications_total\{[^}]*result="mismatch"[^}]*\} (\S+)$', text, re.M))


def _data(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 255, n, dtype=np.uint8)


def _reads(client: tc.Client, remote: tc.Client, art: tc.Artifact) -> list[np.ndarray]:
    """The honest client's reads: a mapping (same host), and the data plane."""
    return [art.tensor(like="numpy"), remote.artifact(art.id).tensor(like="numpy")]


@pytest.mark.parametrize("size,later", [(MiB, False), (6 * MiB, False), (6 * MiB, True)],
                         ids=["digest-first", "hash-while-writing", "wrong-digests-at-commit"])
def test_an_honest_put_after_a_lie_reads_its_own_bytes(cluster: LocalCluster, remote: tc.Client, size: int,
                                                       later: bool) -> None:
    """The honest put deduplicates nothing onto the lie (blob or artifact already in the tier): it is checked,
    dropped and counted, and the honest bytes are written afresh. (1 MiB: the client hashes before PutBegin;
    6 MiB: it hashes while it writes, the digests come with the commit.)"""
    x = _data(size + later, size)
    before = mismatches(cluster, "w0")
    bad = lie(cluster.workers["w0"].address, x, later=later)
    with tc.connect(cluster.address) as client:
        art = client.put(x)
        assert art.id == bad.id  # the same content: the same artifact
        for got in _reads(client, remote, art):
            assert np.array_equal(got, x)
        assert mismatches(cluster, "w0") == before + 1
        client.delete(art.id)


def test_a_lie_on_another_worker_is_never_read(cluster: LocalCluster, remote: tc.Client) -> None:
    """The liar's copy is a replica of the honest artifact too (same content, same id): reads that reach it
    find it fails its check (it is dropped) and go on to the honest copy."""
    x = _data(7, 2 * MiB)
    bad = lie(cluster.workers["w0"].address, x)
    with tc.connect(cluster.address) as client:
        art = client.put(x, on="w1")
        assert art.id == bad.id and {r.worker_id for r in art.replicas} == {"w0", "w1"}
        for got in _reads(client, remote, art):
            assert np.array_equal(got, x)
        assert {r.worker_id for r in art.refresh().replicas} == {"w1"}  # the bad copy was dropped
        client.delete(art.id)


def test_an_unchecked_honest_put_reads_back_and_is_trusted_once_checked(cluster: LocalCluster,
                                                                       remote: tc.Client) -> None:
    x = _data(9, 3 * MiB)
    before = mismatches(cluster, "w0")
    with tc.connect(cluster.address) as client:
        art = client.put(x)
        for got in [*_reads(client, remote, art), client.put(x).tensor(like="numpy")]:
            assert np.array_equal(got, x)
        assert mismatches(cluster, "w0") == before
        client.delete(art.id)


def test_a_same_host_lookup_names_no_place_of_a_lie(cluster: LocalCluster) -> None:
    """A lookup by a caller on the liar's host (the gateway holds the lie, unchecked) names no places: the read
    asks, the check runs there and fails, and the caller gets a typed error, never the liar's bytes."""
    x = _data(11, 2 * MiB)
    before = mismatches(cluster, "w0")
    bad = lie(cluster.workers["w0"].address, x)
    with tc.connect(cluster.workers["w0"].address) as client:
        with pytest.raises((NotFound, Unavailable)):  # its only copy is condemned: nothing left to read
            got = client.artifact(bad.id).tensor(like="numpy")
            assert np.array_equal(got, x), "the liar's bytes were read"
        assert mismatches(cluster, "w0") == before + 1
