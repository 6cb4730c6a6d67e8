"""Same-host reads without a round trip: where a worker said an artifact's tensors are, kept by the caller.

Owns: ``ReadMaps``, the places (file, offset, size) of memory-tier tensors that a same-host worker named in
answer to a ``MapTensors``, by (artifact, worker), least recently used first out beyond ``max_entries``;
and the reads served from them, counted per worker until they are reported (``take_reports``), so that the
worker's least-recently-used order and its get metrics still see every read. Thread-safe: a synchronous
client reads from kept places on the caller's thread.

Why a kept place stays right. A worker marks every segment it names to a caller ``exported``: from then on
the segment never goes back to the stock, and the pages of its freed blobs are never handed out again while
it lives (``pool.memory``). An artifact is immutable. So while the segment's file exists, the bytes at the
place are the tensor's. Once the segment goes, its file is unlinked: mapping it fails (``SegmentGone``), the
place is forgotten and the caller asks the worker again. Only memory-tier places are kept: a checkpoint
registered in place is a file its owner may rewrite.

What this gives up: an artifact deleted by another client (or evicted from the worker) can still be read
here while its memory lives, as a mapping made just before the deletion can. The bytes are the artifact's,
never other ones. ``delete`` through this client forgets its places at once.

Does not own: mapping files (``pool.segments.map_private``), sending the reports or deciding when
(``client.reads``). No sockets, files or clocks.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from tensorcast.records import SegmentRef

__all__ = ["ReadMaps"]


class ReadMaps:
    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self._places: OrderedDict[tuple[str, str], dict[str, SegmentRef]] = OrderedDict()
        self._reads: dict[str, dict[str, list[int]]] = {}  # worker address -> artifact id -> [reads, bytes]
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._places)

    def remember(self, artifact_id: str, worker_id: str, names: Sequence[str],
                 refs: Sequence[SegmentRef | None]) -> None:
        """The places a worker named for ``names`` (None: not mappable, not kept)."""
        if self.max_entries <= 0:
            return
        key = (artifact_id, worker_id)
        named = {n: r for n, r in zip(names, refs, strict=True) if r is not None and r.tier == "memory"}
        if not named:
            return
        with self._lock:
            self._places.setdefault(key, {}).update(named)
            self._places.move_to_end(key)
            while len(self._places) > self.max_entries:
                self._places.popitem(last=False)

    def places(self, artifact_id: str, worker_id: str, names: Sequence[str]) -> list[SegmentRef] | None:
        """The kept places of all of ``names``, or None unless every one is known."""
        with self._lock:
            places = self._places.get((artifact_id, worker_id))
            if places is None or any(n not in places for n in names):
                return None
            self._places.move_to_end((artifact_id, worker_id))
            return [places[n] for n in names]

    def forget(self, artifact_id: str, worker_id: str | None = None) -> None:
        """Drop the places of an artifact (on one worker, or on all: it was deleted)."""
        with self._lock:
            for key in [k for k in self._places if k[0] == artifact_id and worker_id in (None, k[1])]:
                del self._places[key]

    def count_read(self, address: str, artifact_id: str, nbytes: int) -> None:
        """A read served from kept places of the worker at ``address``, to report to it."""
        with self._lock:
            entry = self._reads.setdefault(address, {}).setdefault(artifact_id, [0, 0])
            entry[0] += 1
            entry[1] += nbytes

    def take_reports(self, address: str) -> list[tuple[str, int, int]]:
        """The reads counted for one worker since the last call: ``(artifact id, reads, bytes)``."""
        with self._lock:
            reads = self._reads.pop(address, {})
        return [(aid, n, b) for aid, (n, b) in reads.items()]

    def pending(self) -> list[str]:
        """Workers with reads not reported yet."""
        with self._lock:
            return list(self._reads)
