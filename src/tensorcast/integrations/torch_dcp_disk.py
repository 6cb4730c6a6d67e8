"""An existing Distributed Checkpoint directory on disk, registered in place as a TensorCast checkpoint.

Owns: ``register_dcp_dir``, which turns what ``FileSystemWriter`` wrote (``.metadata`` and ``*.distcp``) into a
checkpoint ``TensorCastReader``, ``full_state_dict`` and ``publish_weights`` read like one ``TensorCastWriter``
saved: the directory registered in place as one artifact (a worker that sees the path reads each chunk's
bytes where they lie, on first use), and a manifest under the checkpoint's key naming each chunk's tensor in
it. Does not own: locating the chunks in the files (``weights.dcp_files``, on the worker, without torch) or
reading (``integrations.torch_dcp``).
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import numpy as np
from torch.distributed.checkpoint.metadata import Metadata

from tensorcast.client.sync import Artifact, Client
from tensorcast.errors import InvalidArgument
from tensorcast.integrations.torch_dcp_layout import METADATA_TENSOR, Stored, rank_key
from tensorcast.weights.dcp_files import METADATA_FILE, dcp_metadata_classes, load_dcp_metadata, stored_name

__all__ = ["register_dcp_dir"]


def register_dcp_dir(client: Client, path: str | os.PathLike[str], key: str, *, policy: str = "durable",
                     on: str | None = None, timeout: float | None = None) -> Artifact:
    """Register the DCP checkpoint directory ``path`` in place as checkpoint ``key`` (no tensor byte read
    now). The worker (the gateway, or ``on``) must see ``path`` under its allowed roots, as for ``from_disk``.
    Chunks stored transposed, compressed or encrypted are refused (``InvalidArgument``): they have no bytes
    to serve in place. ``policy``: the manifest's placement. Returns the manifest's artifact."""
    files = client.from_disk(path, key=rank_key(key, 0), on=on, timeout=timeout)
    raw = np.asarray(files.tensor(METADATA_FILE, like="numpy")).tobytes()
    metadata: Any = load_dcp_metadata(raw, dcp_metadata_classes())
    if not isinstance(metadata, Metadata):
        raise InvalidArgument(f"{path}: {METADATA_FILE} does not hold DCP metadata")
    entries = metadata.state_dict_metadata
    metadata.storage_data = {index: Stored(files.id, stored_name(index, entries[index.fqn]))
                             for index in (metadata.storage_data or {})}
    manifest = np.frombuffer(pickle.dumps(metadata), np.uint8)
    return client.put({METADATA_TENSOR: manifest}, key=key, policy=policy)
