"""The global store's benchmark-only page index, against real processes: served only with ``gs.page_index``,
bounded per request and in all; and a full database (``gs.sqlite_max_bytes`` stands in for a full disk) is a
typed, retryable ``ResourceExhausted`` while the store goes on serving (it used to be ``INTERNAL``)."""

from __future__ import annotations

import time

import numpy as np
import pytest

import tensorcast as tc
from tensorcast.errors import InvalidArgument, ResourceExhausted
from tensorcast.testing import running_cluster
from tensorcast.wire.kv_messages import PageIndexGet, PageIndexPut

LIVENESS = 2.0  # gs.worker_liveness_timeout here
BOUNDS = {"gs.page_index": "true", "gs.page_index_max_keys": 4096, "gs.page_index_max_entries": 2000,
          "gs.sqlite_max_bytes": 2 * 1024**2, "gs.worker_liveness_timeout": LIVENESS}


def index_put(client: tc.Client, keys: list[str]) -> None:
    client._run(client.aio.caller.call(PageIndexPut(keys=tuple(keys), worker_id="w0")))


def index_get(client: tc.Client, keys: list[str]) -> list[str]:
    reply = client._run(client.aio.caller.call(PageIndexGet(keys=tuple(keys))))
    return list(reply.holders)


def test_without_the_switch_the_store_refuses_its_page_index() -> None:
    with running_cluster(workers=1) as cluster, tc.connect(cluster.address) as client:
        for call in (lambda: index_put(client, ["k"] * 1000), lambda: index_get(client, ["k"])):
            with pytest.raises(InvalidArgument, match=r"gs\.page_index"):
                call()
        assert client.list_workers()  # the store serves on


def test_bounded_and_a_full_database_is_resource_exhausted() -> None:
    with running_cluster(workers=1, config=BOUNDS) as cluster, tc.connect(cluster.address) as client:
        data = np.arange(1024, dtype=np.int64)
        client.put(data, key="before")
        index_put(client, ["a", "b"])
        assert index_get(client, ["b", "c"]) == ["w0", ""]
        with pytest.raises(InvalidArgument, match="page_index_max_keys"):
            index_put(client, [f"{i}" for i in range(4097)])  # over the per-request bound
        with pytest.raises(InvalidArgument, match="page_index_max_request_bytes"):
            index_put(client, ["x" * (1 << 20)])
        # Fill the database: 300 keys of 1000 bytes a request (~600 KB with the key's index).
        written, full = 2, None
        for r in range(6):
            try:
                index_put(client, [f"{r:03d}{i:05d}".ljust(1000, "k") for i in range(300)])
                written += 300
            except ResourceExhausted as exc:
                full = exc
                break
        assert full is not None and full.retryable and "is full" in full.message, full
        assert "page_index_max_entries" not in full.message  # the database, not the index's own bound
        # The store serves on: reads, and the workers' heartbeats (rows updated in place) keep them alive.
        deadline = time.monotonic() + 3 * LIVENESS
        while time.monotonic() < deadline:
            assert all(w.alive for w in client.list_workers())
            time.sleep(LIVENESS / 4)
        assert np.array_equal(client.artifact("before").tensor(like="numpy"), data)
        assert index_get(client, ["a"]) == ["w0"]
        # Over the bound in all (as counted since the store started): refused before the database is touched.
        with pytest.raises(ResourceExhausted, match="page_index_max_entries"):
            index_put(client, [f"t{i}" for i in range(2000 - written + 1)])
