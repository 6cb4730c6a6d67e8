"""Try to break the zero-copy invariant: memory handed out without a copy is never reused for other bytes."""

from __future__ import annotations

import numpy as np

import tensorcast as tc

MiB = 1 << 20


def test_mapped_large_tensor_survives_delete_and_reuse(client: tc.Client) -> None:
    first = np.full(4 * MiB, 7, np.uint8)
    art = client.put(first)
    mapped = art.tensor(like="numpy")  # a private mapping of the worker's segment
    client.delete(art.id)
    # Same-size puts right after: a recycled segment would now hold these bytes.
    others = [client.put(np.full(4 * MiB, 100 + i, np.uint8)) for i in range(3)]
    assert mapped.min() == 7 and mapped.max() == 7
    for o in others:
        client.delete(o.id)


def test_small_tensor_is_mapped_and_its_pages_never_reused(client: tc.Client) -> None:
    small = np.full(1000, 3, np.uint8)  # a put's small tensors share a pack chunk, which callers map too
    art = client.put(small)
    got = art.tensor(like="numpy")
    assert art.last_diagnostics is not None and art.last_diagnostics.transport == "shared-memory"
    base = got
    while getattr(base, "base", None) is not None:
        base = base.base
    assert isinstance(getattr(base, "obj", base), __import__("mmap").mmap), "a small tensor was copied, not mapped"
    client.delete(art.id)
    refill = [client.put(np.full(1000, 200 + i, np.uint8)) for i in range(5)]  # freed pages would be taken now
    assert np.array_equal(got, small)
    for r in refill:
        client.delete(r.id)
