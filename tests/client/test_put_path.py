"""The put-path choice (``client.put_path``) and the worker's digests-later admission
(``pool.placement.admit_digests_later``): pure decisions, table-driven."""

from __future__ import annotations

import pytest

from tensorcast.client.put_path import (
    HASH_WHILE_WRITING_BYTES,
    INLINE_PUT_BYTES,
    INLINE_WRITE_BYTES,
    PutPath,
    PutTurn,
    after,
    choose_put_path,
    on_thread,
)
from tensorcast.pool.placement import PRESETS, admit_digests_later
from tensorcast.pool.state import PoolState

MiB = 1 << 20
BIG = 64 * MiB


@pytest.mark.parametrize(("total", "unhashed", "same_host", "path"), [
    (0, 0, True, PutPath.INLINE),                                    # an empty artifact: one request
    (INLINE_PUT_BYTES, INLINE_PUT_BYTES, False, PutPath.INLINE),     # the limit is inclusive, any host
    (INLINE_PUT_BYTES, 0, True, PutPath.INLINE),
    (INLINE_PUT_BYTES + 1, INLINE_PUT_BYTES + 1, False, PutPath.STREAMED),
    (BIG, BIG, False, PutPath.STREAMED),                             # another host: digests first, payloads
    (BIG, 0, False, PutPath.STREAMED),
    (INLINE_PUT_BYTES + 1, INLINE_PUT_BYTES + 1, True, PutPath.HASH_FIRST),  # few bytes to hash: first
    (BIG, HASH_WHILE_WRITING_BYTES - 1, True, PutPath.HASH_FIRST),   # a publisher's mostly-known tensors
    (BIG, HASH_WHILE_WRITING_BYTES, True, PutPath.HASH_WHILE_WRITING),
    (BIG, BIG, True, PutPath.HASH_WHILE_WRITING),
])
def test_the_path_a_put_takes(total: int, unhashed: int, same_host: bool, path: PutPath) -> None:
    assert choose_put_path(total, unhashed, same_host) is path


@pytest.mark.parametrize(("total", "unhashed"), [(-1, 0), (10, 11), (10, -1)])
def test_impossible_sizes_are_refused(total: int, unhashed: int) -> None:
    with pytest.raises(ValueError, match="not hashed"):
        choose_put_path(total, unhashed, True)


@pytest.mark.parametrize(("path", "turn", "then"), [
    (PutPath.HASH_WHILE_WRITING, PutTurn.DIGESTS_FIRST, PutPath.HASH_FIRST),
    (PutPath.HASH_WHILE_WRITING, PutTurn.SHM_UNREACHABLE, PutPath.STREAMED),
    (PutPath.HASH_FIRST, PutTurn.SHM_UNREACHABLE, PutPath.STREAMED),
    (PutPath.HASH_FIRST, PutTurn.DIGESTS_FIRST, None),     # the worker asks for digests only when they come last
    (PutPath.INLINE, PutTurn.DIGESTS_FIRST, None),
    (PutPath.INLINE, PutTurn.SHM_UNREACHABLE, None),       # an inline put maps nothing
    (PutPath.STREAMED, PutTurn.SHM_UNREACHABLE, None),
    (PutPath.STREAMED, PutTurn.DIGESTS_FIRST, None),
])
def test_turns_on_the_way(path: PutPath, turn: PutTurn, then: PutPath | None) -> None:
    if then is None:
        with pytest.raises(ValueError, match="cannot take"):
            after(path, turn)
    else:
        assert after(path, turn) is then


def test_every_path_ends_after_at_most_two_turns() -> None:
    """No put loops: from any path, any sequence of turns reaches a path that takes none."""
    def walk(path: PutPath, depth: int) -> int:
        deepest = depth
        for turn in PutTurn:
            try:
                nxt = after(path, turn)
            except ValueError:
                continue
            deepest = max(deepest, walk(nxt, depth + 1))
        return deepest

    assert max(walk(p, 0) for p in PutPath) == 2


@pytest.mark.parametrize(("nbytes", "threaded"), [(0, False), (INLINE_WRITE_BYTES - 1, False),
                                                 (INLINE_WRITE_BYTES, True), (BIG, True)])
def test_copies_and_hashes_on_threads_only_when_large(nbytes: int, threaded: bool) -> None:
    assert on_thread(nbytes) is threaded


def _pool(capacity: int, used: int = 0, reserved: int = 0) -> PoolState:
    state = PoolState(capacity)
    state.used, state.reserved = used, reserved
    return state


@pytest.mark.parametrize(("policy", "capacity", "used", "reserved", "need", "admitted", "why"), [
    ("cache", 100 * MiB, 0, 0, 10 * MiB, True, "room below the watermark"),
    ("cache", 100 * MiB, 80 * MiB, 0, 10 * MiB, True, "exactly at the watermark (0.9)"),
    ("cache", 100 * MiB, 80 * MiB, 0, 10 * MiB + 1, False, "above the watermark: housekeeping would evict"),
    ("cache", 100 * MiB, 70 * MiB, 15 * MiB, 10 * MiB, False, "reserved bytes count toward the watermark"),
    ("cache", 100 * MiB, 95 * MiB, 0, 10 * MiB, False, "does not fit: it would evict now"),
    ("durable", 100 * MiB, 0, 0, 10 * MiB, True, "memory preferred, room"),
    ("warm", 100 * MiB, 0, 0, 10 * MiB, True, "memory required, room"),
    ("pinned", 100 * MiB, 89 * MiB, 0, 2 * MiB, False, "memory required, above the watermark"),
])
def test_digests_later_admission(policy: str, capacity: int, used: int, reserved: int, need: int,
                                 admitted: bool, why: str) -> None:
    assert admit_digests_later(PRESETS[policy], _pool(capacity, used, reserved), need, 0.9) is admitted, why


def test_a_placement_that_skips_memory_always_wants_the_digests_first() -> None:
    from tensorcast.records import Placement
    disk_only = Placement(name="disk-only", memory="none", disk="required")
    assert not admit_digests_later(disk_only, _pool(100 * MiB), 1, 0.9)
