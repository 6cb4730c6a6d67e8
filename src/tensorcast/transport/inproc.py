"""An in-process transport: data servers and fetches within one Python process, for unit tests.

Owns: a registry of data servers by address (``inproc:N``) and a ``fetch`` that copies a requested range
straight out of the server's ``SourceLease`` into the destination, checking every chunk against the
sender's checksum exactly as the TCP transport does (so checksum failures, fault injection, deadlines,
ranges and slices are tested without sockets or processes). Not for production: nothing crosses a process.
"""

from __future__ import annotations

import itertools
import threading
import time

import msgspec
import xxhash

from tensorcast import clock
from tensorcast.checksums import CHUNK_BYTES, ChunkCorrupted
from tensorcast.errors import DeadlineExceeded, InvalidArgument, Unavailable
from tensorcast.transport.base import FetchStats, SourceOpener, split_ranges
from tensorcast.wire.messages import DataRequest

__all__ = ["InProcDataServer", "InProcTransport"]

_servers: dict[str, InProcDataServer] = {}
_lock = threading.Lock()
_ids = itertools.count(1)


class InProcDataServer:
    def healthy(self) -> bool:
        return True

    def __init__(self, open_source: SourceOpener, *, corrupt_chunks: int = 0) -> None:
        self.open_source = open_source
        self.address = ""
        self.bytes_sent = 0
        self.active = 0
        self._corrupt_left = corrupt_chunks
        self._lock = threading.Lock()

    def start(self, host: str = "", port: int = 0) -> str:
        self.address = f"inproc:{next(_ids)}"
        with _lock:
            _servers[self.address] = self
        return self.address

    def close(self) -> None:
        with _lock:
            _servers.pop(self.address, None)

    def send_into(self, req: DataRequest, dest: memoryview, sums: list[int], first_chunk: int) -> str:
        """Copy the requested range into ``dest`` chunk by chunk, each checked against the source's checksum."""
        lease = self.open_source(req)
        with self._lock:
            self.active += 1
        try:
            whole = lease.view
            length = len(whole) - req.offset if req.length < 0 else req.length
            if req.offset < 0 or length != len(dest) or req.offset + length > len(whole):
                raise InvalidArgument(f"range [{req.offset}, {req.offset + len(dest)}) outside {len(whole)} bytes")
            learned: list[int] = []
            for i, start in enumerate(range(0, length, CHUNK_BYTES)):
                src = whole[req.offset + start : req.offset + min(start + CHUNK_BYTES, length)]
                expected = xxhash.xxh3_64_intdigest(src)
                if len(src) == CHUNK_BYTES or req.offset + start + len(src) == len(whole):  # a whole grid chunk
                    learned.append(expected)
                piece = dest[start : start + len(src)]
                piece[:] = src
                with self._lock:
                    corrupt, self._corrupt_left = self._corrupt_left > 0, max(self._corrupt_left - 1, 0)
                if corrupt and len(piece):
                    piece[len(piece) // 2] ^= 0xFF
                got = xxhash.xxh3_64_intdigest(piece)
                sums[first_chunk + i] = got
                if got != expected:
                    raise ChunkCorrupted(f"chunk at byte {req.offset + start} of {req.name!r} from {self.address} "
                                         "failed its checksum")
                self.bytes_sent += len(piece)
            if lease.learn is not None and learned and req.offset % CHUNK_BYTES == 0 and not req.slices:
                lease.learn(req.offset // CHUNK_BYTES, learned)
            if lease.sent is not None:
                lease.sent(length)
            return lease.tier
        finally:
            with self._lock:
                self.active -= 1
            lease.release()


class InProcTransport:
    kind = "inproc"

    def fetch(self, address: str, request: DataRequest, dest: memoryview, *, streams: int = 1,
              deadline: float | None = None, trace_id: str = "", checksums: list[int] | None = None) -> FetchStats:
        t0 = time.perf_counter()
        with _lock:
            server = _servers.get(address)
        if server is None:
            raise Unavailable(f"no in-process data server at {address}")
        if deadline is not None and clock.time() >= deadline:
            raise DeadlineExceeded("data transfer: deadline passed", trace_id=trace_id)
        ranges = split_ranges(len(dest), streams, bool(request.slices))
        sums = [0] * (-(-len(dest) // CHUNK_BYTES))
        tier = ""
        for lo, hi in ranges:
            req = msgspec.structs.replace(request, offset=request.offset + lo, length=hi - lo)
            tier = server.send_into(req, dest[lo:hi], sums, lo // CHUNK_BYTES)
        if checksums is not None:
            checksums[:] = sums
        return FetchStats(bytes=len(dest), seconds=time.perf_counter() - t0, streams=len(ranges), tier=tier)

    def serve(self, open_source: SourceOpener, *, corrupt_chunks: int = 0) -> InProcDataServer:
        return InProcDataServer(open_source, corrupt_chunks=corrupt_chunks)

    def close(self) -> None:
        return None
