"""Same-host reads from places a worker named before (``client.read_maps``): no round trip after the first
read, the same bytes, writes that stay private to each result, a place forgotten once its segment is gone,
and every read still reported to the worker (its get metrics and least-recently-used order)."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import tensorcast as tc
import tensorcast.aio
from tensorcast.client.read_maps import ReadMaps
from tensorcast.errors import InvalidArgument, NotFound
from tensorcast.records import SegmentRef
from tensorcast.testing import running_cluster
from tensorcast.wire.messages import GetArtifact, MapTensors, ReportReads

REPORT_S = 0.2
CHUNK = 4 << 20  # the worker's pack chunks: a larger tensor gets a segment of its own


def _ref(path: str, offset: int = 0, tier: str = "memory") -> SegmentRef:
    return SegmentRef(path=path, size=16, offset=offset, tier=tier)


def test_places_are_kept_per_artifact_and_worker_and_bounded() -> None:
    maps = ReadMaps(max_entries=2)
    maps.remember("a", "w0", ["x", "y", "z"], [_ref("/f", 0), _ref("/f", 4096), None])
    assert maps.places("a", "w0", ["y", "x"]) == [_ref("/f", 4096), _ref("/f", 0)]
    assert maps.places("a", "w0", ["x", "z"]) is None  # z was not mappable: every name or nothing
    assert maps.places("a", "w1", ["x"]) is None  # another worker's replica is another place
    maps.remember("b", "w0", ["x"], [_ref("/disk", tier="disk")])
    assert maps.places("b", "w0", ["x"]) is None  # a disk-tier file may be rewritten: never kept
    maps.remember("c", "w0", ["x"], [_ref("/g")])
    maps.places("a", "w0", ["x"])  # a use: "a" is now the most recent
    maps.remember("d", "w0", ["x"], [_ref("/h")])
    assert maps.places("b", "w0", ["x"]) is None and maps.places("c", "w0", ["x"]) is None
    assert maps.places("a", "w0", ["x"]) is not None and maps.places("d", "w0", ["x"]) is not None
    maps.forget("a")
    assert maps.places("a", "w0", ["x"]) is None and len(maps) == 1
    assert ReadMaps(max_entries=0).places("a", "w0", ["x"]) is None


def test_reads_are_counted_per_worker_until_taken() -> None:
    maps = ReadMaps()
    maps.count_read("w0:1", "a", 100)
    maps.count_read("w0:1", "a", 100)
    maps.count_read("w0:1", "b", 7)
    maps.count_read("w1:1", "a", 100)
    assert sorted(maps.pending()) == ["w0:1", "w1:1"]
    assert sorted(maps.take_reports("w0:1")) == [("a", 2, 200), ("b", 1, 7)]
    assert maps.take_reports("w0:1") == [] and maps.pending() == ["w1:1"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[tc.LocalCluster]:
    # No idle verification: a test that reads unchecked bytes sees them checked by its read, not before it.
    with running_cluster(workers=1, memory_capacity="256MiB",
                         config={"worker.prefault_chunk_bytes": str(CHUNK), "worker.verify_idle_bytes": 0}) as c:
        yield c


@pytest.fixture()
def reader(cluster: tc.LocalCluster) -> Iterator[tc.Client]:
    cfg = tc.Config.from_flat({"client.read_report_seconds": REPORT_S})
    with tc.connect(cluster.address, config=cfg) as c:
        yield c


class CountCalls:
    """Counts the requests of some types a client sends, passing them on."""

    def __init__(self, client: tc.Client, *types: type) -> None:
        self.types, self.seen = types, 0
        inner = client.aio.caller.call

        async def call(msg: Any, *args: Any, **kwargs: Any) -> Any:
            self.seen += isinstance(msg, self.types)
            return await inner(msg, *args, **kwargs)

        client.aio.caller.call = call  # type: ignore[method-assign]


def _kept_gets(cluster: tc.LocalCluster) -> float:
    """The worker's count of gets served from kept places (reported after the fact)."""
    url = next(u for wid, u in cluster.metrics_urls.items() if wid != "gs")
    with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "tensorcast_operations_total" and s.labels.get("path") == "map-kept")


def test_a_second_read_asks_no_one_and_each_result_stays_private(reader: tc.Client) -> None:
    data = np.random.default_rng(1).integers(0, 255, (256, 1024), dtype=np.uint8)
    art = reader.put({"w": data, "b": data[0].copy()})
    maps = CountCalls(reader, MapTensors)
    first = art.tensor_dict(like="numpy")["w"]
    assert maps.seen == 1
    again = [art.tensor("w", like="numpy") for _ in range(3)] + [art.tensor_dict(like="numpy")["w"]]
    assert maps.seen == 1  # the places were kept: no round trip, not even to the client's own loop
    assert all(np.array_equal(t, data) for t in [first, *again])
    first[0, :8] = 255  # copy-on-write: a result's writes stay in that result
    assert np.array_equal(again[0], data) and np.array_equal(art.tensor("w", like="numpy"), data)
    assert art.last_diagnostics is not None and art.last_diagnostics.transport == "shared-memory"


def test_a_sync_view_read_again_asks_no_one(reader: tc.Client) -> None:
    """A view read a second time maps the places kept for its parent on the caller's thread: no lookup of a
    materialized view, no mapping request, the same bytes, whether through the same view or a new one."""
    data = np.random.default_rng(2).integers(0, 255, (256, 1024), dtype=np.uint8)
    art = reader.put({"w": data, "b": data[0].copy()})
    view = art.view({"w": [(0, slice(0, 128))], "b": [(0, slice(8, 16))]})
    calls = CountCalls(reader, MapTensors, GetArtifact)
    first = view.tensor_dict(like="numpy")
    assert calls.seen == 2  # the lookup of a materialized view (none), then the parent's places
    again = [view.tensor_dict(like="numpy"), art.view({"w": [(0, slice(0, 128))], "b": [(0, slice(8, 16))]})
             .tensor_dict(like="numpy"), {"w": view.tensor("w", like="numpy"), "b": view.tensor("b", like="numpy")}]
    assert calls.seen == 2
    for got in [first, *again]:
        assert np.array_equal(got["w"], data[:128]) and np.array_equal(got["b"], data[0, 8:16])
    assert view.last_diagnostics is not None and view.last_diagnostics.transport == "shared-memory"


def test_async_reads_use_kept_places_too(cluster: tc.LocalCluster) -> None:
    import asyncio

    async def main() -> int:
        async with await tc.aio.connect(cluster.address) as c:
            data = np.arange(1 << 16, dtype=np.float32)
            art = await c.put(data)
            seen = 0
            inner = c.caller.call

            async def call(msg: Any, *args: Any, **kwargs: Any) -> Any:
                nonlocal seen
                seen += isinstance(msg, MapTensors)
                return await inner(msg, *args, **kwargs)

            c.caller.call = call  # type: ignore[method-assign]
            for _ in range(3):
                assert np.array_equal(await art.tensor(like="numpy"), data)
            return seen

    assert asyncio.run(main()) == 1


def test_kept_reads_are_reported_to_the_worker(cluster: tc.LocalCluster, reader: tc.Client) -> None:
    art = reader.put(np.ones(1 << 20, dtype=np.uint8))
    reports = CountCalls(reader, ReportReads)
    before = _kept_gets(cluster)
    art.tensor(like="numpy")  # asks the worker (counted there as a plain get)
    reads = 50
    for _ in range(reads):
        art.tensor(like="numpy")
    # Reported at most every REPORT_S: the first at once, the rest together when the interval ends.
    deadline = time.monotonic() + 10 * REPORT_S + 5.0
    while _kept_gets(cluster) - before < reads and time.monotonic() < deadline:
        time.sleep(REPORT_S / 2)
    assert _kept_gets(cluster) - before == reads
    assert 1 <= reports.seen <= 3


def test_this_client_deleting_forgets_at_once(reader: tc.Client) -> None:
    art = reader.put(np.zeros(4096, dtype=np.uint8))
    art.tensor(like="numpy")
    reader.delete(art.id)
    with pytest.raises(NotFound):
        art.tensor(like="numpy")


def test_a_place_whose_segment_went_is_forgotten_and_the_worker_asked(cluster: tc.LocalCluster,
                                                                      reader: tc.Client) -> None:
    data = np.random.default_rng(2).integers(0, 255, CHUNK + (1 << 20), dtype=np.uint8)  # a segment of its own
    art = reader.put(data)
    assert np.array_equal(art.tensor(like="numpy"), data)
    with tc.connect(cluster.address) as other:
        other.delete(art.id)  # its segment goes (unlinked: a caller mapped it, so it is never reused)
    maps = CountCalls(reader, MapTensors)
    with pytest.raises(NotFound):
        art.tensor(like="numpy")
    assert maps.seen >= 1 and len(reader.aio.reader.kept) == 0


def test_a_closed_client_reads_nothing_from_kept_places(cluster: tc.LocalCluster) -> None:
    c = tc.connect(cluster.address)
    art = c.put(np.arange(4096, dtype=np.int32))
    art.tensor(like="numpy")  # its places are kept
    c.close()
    with pytest.raises(InvalidArgument, match="closed"):
        art.tensor(like="numpy")


def test_releasing_a_lease_forgets_its_places(reader: tc.Client) -> None:
    art = reader.put(np.random.default_rng(9).random(4096), ttl=60)  # a caller lease (content of its own)
    art.tensor(like="numpy")
    assert reader.aio.reader.kept.places(art.id, art.info.replicas[0].worker_id, art.tensor_names) is not None
    art.release()
    assert reader.aio.reader.kept.places(art.id, art.info.replicas[0].worker_id, art.tensor_names) is None
    with pytest.raises(NotFound):
        art.tensor(like="numpy")


def test_a_first_read_after_a_lookup_makes_no_call_of_its_own(cluster: tc.LocalCluster, reader: tc.Client) -> None:
    """The gateway on the caller's host names its memory copy's places with the lookup (``GetArtifact`` with
    ``map``): the first read maps them without asking; a caller on another host is named none."""
    data = np.random.default_rng(5).integers(0, 255, (512, 1024), dtype=np.uint8)
    far = tc.Config.from_flat({"client.host_id": "elsewhere"})
    with tc.connect(cluster.address, config=far) as remote:
        art = remote.put({"w": data, "b": data[:2].copy()})  # sent over the socket: hashed by the worker
        looked_up = remote.artifact(art.id)
        assert len(remote.aio.reader.kept) == 0  # no places named to another host (it could not map them)
        assert np.array_equal(looked_up.tensor("b", like="numpy"), data[:2])
    calls = CountCalls(reader, MapTensors)
    got = reader.artifact(art.id).tensor_dict(like="numpy")
    assert calls.seen == 0 and np.array_equal(got["w"], data) and np.array_equal(got["b"], data[:2])
    reader.delete(art.id)


def test_a_lookup_names_no_places_of_bytes_not_checked_yet(cluster: tc.LocalCluster, reader: tc.Client) -> None:
    """A same-host put's bytes are written by its caller, who stated their digest: they are handed out only once
    checked. So the lookup names no places until then; the first read asks (and the check runs there), and the
    lookups after it name them."""
    data = np.random.default_rng(6).integers(0, 255, (512, 1024), dtype=np.uint8)
    with tc.connect(cluster.address) as writer:
        art = writer.put(data)
    calls = CountCalls(reader, MapTensors)
    assert np.array_equal(reader.artifact(art.id).tensor(like="numpy"), data)
    assert calls.seen == 1  # unchecked: named only by the read's own MapTensors, which checked them
    with tc.connect(cluster.address) as later:
        calls = CountCalls(later, MapTensors)
        assert np.array_equal(later.artifact(art.id).tensor(like="numpy"), data) and calls.seen == 0
    reader.delete(art.id)


def test_a_lookup_that_will_not_read_asks_for_no_places(cluster: tc.LocalCluster, reader: tc.Client) -> None:
    """To prefetch, unpin or release a handle, nothing is mapped: the gateway names no places (a named segment
    never goes back to the worker's stock)."""
    data = np.random.default_rng(7).integers(0, 255, (64, 1024), dtype=np.uint8)
    with tc.connect(cluster.address, config=tc.Config.from_flat({"client.host_id": "elsewhere"})) as remote:
        art = remote.put(data)  # checked by the worker: a lookup to read it would be named its places
    handle = reader.lookup(art.id, to_read=False)
    assert len(reader.aio.reader.kept) == 0
    calls = CountCalls(reader, MapTensors)
    assert np.array_equal(handle.tensor(like="numpy"), data) and calls.seen == 1  # read anyway: it asks
    reader.delete(art.id)
