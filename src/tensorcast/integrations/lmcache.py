"""An LMCache remote storage plug-in on TensorCast KV pages: ``TensorCastConnector``.

LMCache (vLLM, SGLang and Dynamo use it) loads it from its configuration::

    remote_storage_plugins: ["tensorcast"]
    extra_config:
      remote_storage_plugin.tensorcast.module_path: tensorcast.integrations.lmcache
      remote_storage_plugin.tensorcast.class_name: TensorCastConnector
      remote_storage_plugin.tensorcast.address: HOST:PORT

Options (``remote_storage_plugin.<name>.*``): ``address`` (default ``TENSORCAST_ADDRESS``), ``token``, ``ttl``
(seconds; default the cluster's ``kv.page_ttl``), ``namespace`` (a word in every key: engines in different
namespaces share nothing), ``threads`` (pool calls in flight, 4), ``max_page_bytes`` (at most the shard
homes' ``kv.max_page_bytes``; default this process's). Multi-process mode: ``integrations.lmcache_l2``.

A chunk is a *head* page under ``lmc/[NAMESPACE/]KEY`` (LMCache's ``CacheEngineKey`` string: model, world
size, rank, chunk hash, dtype; hashed if too long) with a header and the chunk's first bytes, and, past one
page, *tails* ``HEAD/CHECKSUM/pN`` with the rest. The header (length, shapes, dtypes, memory format, and an
XXH3-64 of key, header and chunk) is in the head, not under a second key: a lookup is one key per chunk, a
one-page chunk one round trip, and a header never describes another write's bytes. Tails are named by the
checksum and written before their head: a head present means its own tails were stored. A page that does
not decode, sizes that do not add up, a missing tail or a wrong checksum is a miss, never wrong bytes; so
is a chunk LMCache has no CPU buffer for at once (a read never waits for memory). Cost: a copy of the
head's bytes each way and a checksum pass per read; tails move zero-copy.

Pool calls run on this plug-in's threads, never on LMCache's event loop. A chunk the pool holds is not
sent again; one another engine stored meanwhile with other bytes (KV computed twice can differ in its last
bits) stays theirs. Pages expire by TTL or LRU: no ``remove_sync`` or ``list``. Owns: key naming, the page
format (``encode_chunk``, ``ChunkPages``), the LMCache-facing class. Does not own: where pages live or how
they move (``client.kv``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import blake3
import msgspec
import numpy as np
import torch
import xxhash
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

import tensorcast as tc
from tensorcast.errors import AlreadyExists, InvalidArgument, TensorCastError

__all__ = ["ChunkMeta", "ChunkPages", "TensorCastConnector", "connect_pages", "encode_chunk", "options_of"]

log = logging.getLogger("lmcache.tensorcast")  # beside LMCache's own lines

MAX_KEY_BYTES = 512
_TAIL_ROOM = 32  # a tail key's "/CHECKSUM/pN" fits in what a head key leaves
_MAGIC = b"TCLM"
_VERSION = 1
_FIXED = struct.Struct("<4sIQ")  # magic, header bytes, XXH3-64 of key + header + chunk
_ALIGN = 64  # the chunk's bytes start aligned in the head page
OPTIONS = ("address", "token", "ttl", "namespace", "threads", "max_page_bytes")


class ChunkMeta(msgspec.Struct, array_like=True, frozen=True):
    """What a chunk's bytes are: LMCache allocates (or checks) the buffer they go into from this."""

    version: int
    length: int
    fmt: int
    shapes: list[list[int]]
    dtypes: list[str]

    @classmethod
    def of(cls, memory_obj: Any, length: int) -> ChunkMeta:
        return cls(_VERSION, length, int(memory_obj.get_memory_format().value),
                   [list(map(int, s)) for s in memory_obj.get_shapes()],
                   [str(d).removeprefix("torch.") for d in memory_obj.get_dtypes()])

    def torch_layout(self) -> tuple[list[torch.Size], list[torch.dtype], Any] | None:
        """Shapes, dtypes and LMCache memory format, or None unless this process can name them and they
        add up to ``length`` bytes."""
        dtypes = [d for d in (getattr(torch, name, None) for name in self.dtypes) if isinstance(d, torch.dtype)]
        if len(dtypes) != len(self.dtypes) or len(dtypes) != len(self.shapes) \
                or any(n < 0 for s in self.shapes for n in s) \
                or sum(math.prod(s) * d.itemsize for s, d in zip(self.shapes, dtypes, strict=True)) != self.length:
            return None
        try:
            return [torch.Size(s) for s in self.shapes], dtypes, MemoryFormat(self.fmt)
        except ValueError:
            return None


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(ChunkMeta)


def _offset(meta_bytes: int) -> int:
    return -(-(_FIXED.size + meta_bytes) // _ALIGN) * _ALIGN


def _checksum(key: str, meta: bytes | memoryview, chunk: memoryview) -> int:
    h = xxhash.xxh3_64(key.encode())
    h.update(meta)
    h.update(chunk)
    return h.intdigest()


def byte_view(buffer: Any) -> memoryview:
    return memoryview(buffer).cast("B")


def encode_chunk(key: str, chunk: memoryview, meta: ChunkMeta, max_page_bytes: int) -> list[tuple[str, Any]]:
    """The pages of one chunk, head first: ``(key, page)``. Tails are views of ``chunk`` (no copy)."""
    raw = _ENC.encode(meta)
    offset = _offset(len(raw))
    if offset >= max_page_bytes:
        raise InvalidArgument(f"pages of {max_page_bytes} bytes cannot hold a chunk header of {offset}")
    first = min(len(chunk), max_page_bytes - offset)
    head = np.zeros(offset + first, np.uint8)
    checksum = _checksum(key, raw, chunk)
    _FIXED.pack_into(head.data, 0, _MAGIC, len(raw), checksum)
    head[_FIXED.size:_FIXED.size + len(raw)] = np.frombuffer(raw, np.uint8)
    head[offset:] = np.frombuffer(chunk[:first], np.uint8)
    return [(key, head)] + [(_tail(key, checksum, i), chunk[a:a + max_page_bytes])
                            for i, a in enumerate(range(first, len(chunk), max_page_bytes), 1)]


def _tail(key: str, checksum: int, i: int) -> str:
    return f"{key}/{checksum:016x}/p{i}"


def _decode_head(page: np.ndarray[Any, Any]) -> tuple[ChunkMeta, memoryview, int, memoryview] | None:
    """A head page's meta, raw header, checksum and chunk bytes; None unless it is a well-formed head."""
    magic, n, checksum = _FIXED.unpack_from(page.data) if page.nbytes >= _FIXED.size else (b"", 0, 0)
    offset = _offset(n)
    if magic != _MAGIC or page.nbytes < offset:
        return None
    raw = byte_view(page)[_FIXED.size:_FIXED.size + n]
    try:
        meta = _DEC.decode(raw)
    except msgspec.DecodeError:
        return None
    first = page.nbytes - offset
    # A chunk split in parts fills its head page: a head shorter than its chunk must carry some of it.
    if meta.version != _VERSION or first > meta.length or (first < meta.length and first == 0):
        return None
    return meta, raw, checksum, byte_view(page)[offset:]


# A reader's target: from a chunk's index and meta, (the object filled, its writable bytes), or None (skip).
Target = Callable[[int, ChunkMeta], "tuple[Any, memoryview] | None"]


@dataclass
class _Filling:  # a chunk being read: its object and bytes, header and checksum to check, tails to receive
    obj: Any
    view: memoryview
    raw: memoryview
    checksum: int
    tails: list[tuple[int, str, memoryview]]


class ChunkPages:
    """Chunks as TensorCast pages under one key prefix, through a sync client (thread-safe; blocking)."""

    def __init__(self, client: Any, prefix: str, *, ttl: float | None, max_page_bytes: int) -> None:
        self.client = client
        self.prefix = prefix
        self.ttl = ttl
        self.max_page_bytes = max_page_bytes

    def key(self, name: str) -> str:
        key = self.prefix + name
        if len(key.encode()) > MAX_KEY_BYTES - _TAIL_ROOM:  # a long model name: keep keys valid, still unique
            key = f"{self.prefix}h/{blake3.blake3(name.encode()).hexdigest()}"
        return key

    def leading(self, names: Sequence[str]) -> int:
        """How many leading chunks are stored."""
        return self.client.kv.exists([self.key(n) for n in names]) if names else 0

    def present(self, names: Sequence[str]) -> list[bool]:
        return self.client.kv.present([self.key(n) for n in names]) if names else []

    def store(self, names: Sequence[str], objects: Sequence[Any]) -> list[int]:
        """Store each object's bytes (LMCache ``MemoryObj``) unless its chunk is stored; the indexes sent."""
        keys = [self.key(n) for n in names]
        held = self.client.kv.present(keys) if keys else []
        todo = [i for i, h in enumerate(held) if not h]
        chunks = []
        for i in todo:
            data = byte_view(objects[i].byte_array)
            chunks.append(encode_chunk(keys[i], data, ChunkMeta.of(objects[i], len(data)), self.max_page_bytes))
        self._put([p for c in chunks for p in c[1:]])  # tails first: a head present means its chunk is whole
        try:
            self._put([c[0] for c in chunks])
        except AlreadyExists:
            # Another writer stored some of these chunks meanwhile with other bytes (KV computed twice can
            # differ in its last bits): theirs stay, with their own tails; the rest go one by one.
            for c in chunks:
                with contextlib.suppress(AlreadyExists):
                    self._put(c[:1])
        return todo

    def _put(self, pages: list[tuple[str, Any]]) -> None:
        if pages:
            self.client.kv.put([k for k, _ in pages], [p for _, p in pages], ttl=self.ttl)

    def load(self, names: Sequence[str], target: Target, release: Callable[[Any], None]) -> list[Any]:
        """Each chunk's object filled by ``target`` (None: a miss). Objects ``target`` gave for chunks that
        turn out to be misses (or for all, if the pool fails) are passed to ``release``."""
        keys = [self.key(n) for n in names]
        heads = self.client.kv.get(keys) if keys else []
        got: list[_Filling | None] = []
        try:
            for key, page in zip(keys, heads, strict=True):
                got.append(None if page is None else self._begin(len(got), key, page, target, release))
            missed = self._receive([t for g in got if g is not None for t in g.tails])
        except BaseException:
            for f in filter(None, got):
                release(f.obj)
            raise
        out = []
        for i, g in enumerate(got):
            if g is not None and (i in missed or _checksum(keys[i], g.raw, g.view) != g.checksum):
                log.warning("TensorCast: chunk %s is incomplete or fails its checksum; a miss", keys[i])
                release(g.obj)
                g = None
            out.append(None if g is None else g.obj)
        return out

    @staticmethod
    def _begin(i: int, key: str, page: np.ndarray[Any, Any], target: Target,
               release: Callable[[Any], None]) -> _Filling | None:
        """Chunk ``i``'s buffer from ``target`` with the head's bytes in it, and where its tails go."""
        head = _decode_head(page)
        if head is None:
            log.warning("TensorCast: page %s is not an LMCache chunk head; a miss", key)
            return None
        meta, raw, checksum, first = head
        dest = target(i, meta)
        if dest is None:
            return None
        obj, view = dest
        if view.nbytes != meta.length:
            release(obj)
            return None
        view[:len(first)] = first
        step = page.nbytes  # a split chunk's head is one whole page, as is every tail but its last
        tails = [(i, _tail(key, checksum, j), view[a:a + step])
                 for j, a in enumerate(range(len(first), meta.length, step), 1)]
        return _Filling(obj, view, raw, checksum, tails)

    def _receive(self, tails: list[tuple[int, str, memoryview]]) -> set[int]:
        """Receive tails into their chunks' buffers; the chunks missing one."""
        if not tails:
            return set()
        try:
            hits = self.client.kv.get_into([k for _, k, _ in tails], [b for _, _, b in tails])
        except InvalidArgument:  # a page larger than its part: that chunk alone is lost, not the batch
            hits = []
            for _, key, buf in tails:
                try:
                    hits += self.client.kv.get_into([key], [buf])
                except InvalidArgument:
                    hits.append(False)
        return {i for (i, _, _), hit in zip(tails, hits, strict=True) if not hit}


def options_of(extra: Mapping[str, Any] | None, plugins: Sequence[str] | None, class_name: str) -> dict[str, Any]:
    """This plug-in's options (``remote_storage_plugin.<name>.*``) from LMCache's ``extra_config``: LMCache
    does not tell a plug-in its name, so it is the one plug-in naming ``class_name`` in this module."""
    extra = dict(extra or {})
    ours = [p for p in plugins or () if extra.get(f"remote_storage_plugin.{p}.module_path") == __name__
            and extra.get(f"remote_storage_plugin.{p}.class_name") == class_name]
    if len(ours) > 1:
        raise InvalidArgument(f"several LMCache plug-ins name {class_name} ({ours}); one per engine")
    if not ours:
        return {}
    prefix = f"remote_storage_plugin.{ours[0]}."
    opts = {k.removeprefix(prefix): v for k, v in extra.items() if k.startswith(prefix)}
    unknown = set(opts) - {"module_path", "class_name", *OPTIONS}
    if unknown:
        raise InvalidArgument(f"unknown TensorCast plug-in options {sorted(unknown)}; known: {list(OPTIONS)}")
    return opts


def connect_pages(opts: Mapping[str, Any], prefix: str) -> ChunkPages:
    """A client and ``ChunkPages`` from the plug-in options."""
    address = opts.get("address") or os.environ.get("TENSORCAST_ADDRESS")
    if not address:
        raise InvalidArgument("the TensorCast LMCache plug-in needs the option 'address' or TENSORCAST_ADDRESS")
    namespace = str(opts.get("namespace") or "")
    if "/" in namespace or len(namespace) > 64:
        raise InvalidArgument(f"namespace {namespace!r}: one word of at most 64 characters, no '/'")
    ttl = float(opts["ttl"]) if opts.get("ttl") is not None else None
    limit = int(opts.get("max_page_bytes") or 0)
    if limit and limit < 4096:
        raise InvalidArgument(f"max_page_bytes {limit}: at least 4096 (a chunk header and some bytes)")
    client = tc.connect(str(address), opts.get("token"))
    return ChunkPages(client, f"{prefix}/{namespace}/" if namespace else f"{prefix}/", ttl=ttl,
                      max_page_bytes=limit or client.aio.config.kv.max_page_bytes)


class TensorCastConnector(RemoteConnector):
    """LMCache's ``RemoteConnector`` on TensorCast; constructed by LMCache as ``cls(loop=, local_cpu_backend=,
    config=)``. A batch of any size costs at most three batched pool calls (one request per shard home)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any = None) -> None:
        config = config if config is not None else local_cpu_backend.config
        super().__init__(config, local_cpu_backend.metadata)
        opts = options_of(config.extra_config, config.remote_storage_plugins, type(self).__name__)
        self.local_cpu_backend = local_cpu_backend
        self.pages = connect_pages(opts, "lmc")
        self.threads = ThreadPoolExecutor(int(opts.get("threads") or 4), thread_name_prefix="tensorcast-lmcache")

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.threads, fn, *args)

    # ----------------------------------------------------------------- lookups
    async def exists(self, key: Any) -> bool:
        return bool((await self._call(self.pages.present, [key.to_string()]))[0])

    def exists_sync(self, key: Any) -> bool:
        return self.pages.present([key.to_string()])[0]

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[Any]) -> int:
        return self.pages.leading([k.to_string() for k in keys])

    async def batched_async_contains(self, lookup_id: str, keys: list[Any], pin: bool = False) -> int:
        return int(await self._call(self.pages.leading, [k.to_string() for k in keys]))

    # ----------------------------------------------------------------- reads
    def _allocate(self, i: int, meta: ChunkMeta) -> tuple[Any, memoryview] | None:
        # No busy loop: a buffer LMCache cannot give now (even by evicting) is a miss, not a wait for memory.
        layout = meta.torch_layout()
        obj = None if layout is None else self.local_cpu_backend.allocate(*layout, busy_loop=False)
        return None if obj is None else (obj, byte_view(obj.byte_array))

    def _load(self, keys: list[Any]) -> list[Any]:
        try:
            return self.pages.load([k.to_string() for k in keys], self._allocate, lambda o: o.ref_count_down())
        except TensorCastError as exc:
            log.warning("TensorCast: loading %d LMCache chunks failed: %s", len(keys), exc)
            return [None] * len(keys)

    async def get(self, key: Any) -> Any:
        return (await self._call(self._load, [key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[Any]) -> list[Any]:
        return list(await self._call(self._load, list(keys)))

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[Any]) -> list[Any]:
        """The leading chunks found (LMCache's contract); buffers read past the first miss are released."""
        objs = await self.batched_get(keys)
        n = next((i for i, o in enumerate(objs) if o is None), len(objs))
        for o in objs[n:]:
            if o is not None:
                o.ref_count_down()
        return objs[:n]

    # ----------------------------------------------------------------- writes (LMCache logs a failed put)
    async def put(self, key: Any, memory_obj: Any) -> None:
        await self._call(self.pages.store, [key.to_string()], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[Any], memory_objs: list[Any]) -> None:
        await self._call(self.pages.store, [k.to_string() for k in keys], list(memory_objs))

    # ----------------------------------------------------------------- housekeeping
    async def list(self) -> list[str]:
        raise NotImplementedError("the TensorCast pool does not list keys")

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        try:
            await self._call(self.pages.client.ping)
        except TensorCastError:
            return 1
        return 0

    async def close(self) -> None:
        await asyncio.to_thread(self.threads.shutdown, wait=True)  # what is in flight finishes first
        await asyncio.to_thread(self.pages.client.close)
