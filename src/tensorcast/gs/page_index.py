"""The benchmark-only page index of the global store: per-page locations kept in its database.

Owns: whether ``PageIndexPut``/``PageIndexGet`` are served at all (only with ``gs.page_index``, which
``benchmarks/kv_pages.py`` turns on to measure what shard homes avoid) and their bounds (keys and bytes per
request, entries and bytes in all). Does not own: the storage (the backend's ``page_index_*``) or the KV
pages themselves (shard homes, ``kv.home``).
"""

from __future__ import annotations

from tensorcast.config import GSConfig
from tensorcast.errors import InvalidArgument, ResourceExhausted
from tensorcast.gs.backend import MetadataBackend

__all__ = ["PageIndex"]


class PageIndex:
    def __init__(self, backend: MetadataBackend, config: GSConfig) -> None:
        self.backend = backend
        self.config = config
        # What was written, counted as written (a key written again counts again) since this store started:
        # an upper bound of what the index holds, kept without scanning it per request.
        self.entries = 0
        self.bytes = 0

    def _served(self, what: str) -> None:
        if not self.config.page_index:
            raise InvalidArgument(f"{what}: the global store's page index is a benchmark switch, off here "
                                  "(gs.page_index); KV page locations are kept by shard homes")

    async def put(self, keys: tuple[str, ...], worker_id: str) -> None:
        self._served("PageIndexPut")
        c = self.config
        size = sum(len(k.encode("utf-8", "surrogatepass")) for k in keys) + len(keys) * len(worker_id.encode())
        if len(keys) > c.page_index_max_keys or size > c.page_index_max_request_bytes:
            raise InvalidArgument(f"PageIndexPut of {len(keys)} keys ({size} bytes) exceeds gs.page_index_max_keys "
                                  f"({c.page_index_max_keys}) or gs.page_index_max_request_bytes "
                                  f"({c.page_index_max_request_bytes})")
        if self.entries + len(keys) > c.page_index_max_entries or self.bytes + size > c.page_index_max_bytes:
            raise ResourceExhausted(f"the global store's page index is full (gs.page_index_max_entries "
                                    f"{c.page_index_max_entries}, gs.page_index_max_bytes {c.page_index_max_bytes})")
        await self.backend.page_index_put(keys, worker_id)
        self.entries += len(keys)
        self.bytes += size

    async def get(self, keys: tuple[str, ...]) -> list[str]:
        self._served("PageIndexGet")
        if len(keys) > self.config.page_index_max_keys:
            raise InvalidArgument(f"PageIndexGet of {len(keys)} keys exceeds gs.page_index_max_keys "
                                  f"({self.config.page_index_max_keys})")
        return await self.backend.page_index_get(keys)
