"""Safetensors checkpoints in object storage (``s3://bucket/prefix``), opened without reading tensor bytes.

Owns: finding a checkpoint's files under a prefix (a single ``.safetensors`` object, or a "directory": its
``model.safetensors.index.json`` when there is one, else every ``*.safetensors`` directly under it) and
reading their headers with ranged GETs, all files at once (``weights.object_streams``): the first 64 KiB
of each object, and the rest of a longer header in a second GET pinned to the object's ETag. Every entry is
validated as for local files (``weights.safetensors``); each tensor's location carries its object's size,
ETag and last-modified time, so that a replaced object changes the checkpoint's identity and later reads
of the old one are refused. ``config.json`` is read when present. Only prefixes a worker allows
(``weights.object_prefixes``) are opened. Does not own: the client, credentials and retries
(``weights.object_store``), or reading tensor bytes (``weights.reader``).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tensorcast.errors import InvalidArgument, NotFound
from tensorcast.weights.object_store import ObjectPrefixes, ObjectStore, ObjectURL
from tensorcast.weights.safetensors import (
    INDEX_FILE,
    MAX_HEADER,
    Checkpoint,
    CheckpointTensor,
    collect,
    header_length,
    parse_header,
    weight_map,
)

__all__ = ["open_object_checkpoint"]

_FIRST_GET = 64 * 1024  # most headers fit (one GET per file); a longer one takes a second


def open_object_checkpoint(url: str, store: ObjectStore, prefixes: ObjectPrefixes | None = None) -> Checkpoint:
    """A checkpoint under ``url``: one object, or a prefix holding a (sharded) checkpoint. With ``prefixes``
    (a worker's) the URL must lie under one of them (``PermissionDenied`` before any request)."""
    root = prefixes.check(url) if prefixes is not None else ObjectURL.parse(url)
    index_map: dict[str, str] | None = None
    if root.key.endswith(".safetensors"):
        files = [(root.name, root)]
        names: list[str] = []
    else:
        names = store.names_under(root)
        if INDEX_FILE in names:
            index_map = weight_map(_json(store, root.child(INDEX_FILE), "index", MAX_HEADER), INDEX_FILE)
            files = [(f, _child(root, f)) for f in sorted(set(index_map.values()))]
        else:
            files = [(n, root.child(n)) for n in sorted(names) if n.endswith(".safetensors")]
        if not files:
            raise NotFound(f"no safetensors files under {root}")
    with ThreadPoolExecutor(max_workers=min(len(files), store.config.object_streams),
                            thread_name_prefix="tensorcast-header") as pool:
        parsed = list(pool.map(lambda f: (f[0], str(f[1]), _parse_object(store, f[1])), files))
    tensors = collect(parsed, index_map)
    config: dict[str, Any] = {}
    if "config.json" in names:
        doc = _json(store, root.child("config.json"), "config", 16 * 1024**2)
        config = doc if isinstance(doc, dict) else {}
    return Checkpoint(str(root).rstrip("/"), tensors, config)


def _child(root: ObjectURL, name: str) -> ObjectURL:
    """A file the index names, which must lie under the checkpoint's prefix (no ``..``, no absolute URL)."""
    if not name or name.startswith("/") or "://" in name:
        raise InvalidArgument(f"{root}/{INDEX_FILE}: file name {name!r} is not a name under the checkpoint")
    return ObjectURL.parse(str(root.child(name)))


def _json(store: ObjectStore, url: ObjectURL, what: str, limit: int) -> Any:
    try:
        return json.loads(store.read_small(url, limit, what))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{url}: unreadable {what} ({exc.__class__.__name__})") from None


def _parse_object(store: ObjectStore, url: ObjectURL) -> list[CheckpointTensor]:
    head, info = store.read_head(url, _FIRST_GET)
    if len(head) < 8:
        raise InvalidArgument(f"{url}: truncated safetensors file (no header length)")
    hlen = header_length(head, str(url), info.size)
    header = bytearray(hlen)
    got = min(hlen, len(head) - 8)
    header[:got] = head[8 : 8 + got]
    if got < hlen:
        store.read_into(url, 8 + got, memoryview(header)[got:], info.etag, "header")
    return parse_header(bytes(header), str(url), info.size, info.mtime_ns, info.etag)
