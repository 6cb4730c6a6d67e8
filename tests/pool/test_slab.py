from __future__ import annotations

from tensorcast.pool.slab import SlabAllocator


def test_size_classes_and_arena_lifecycle() -> None:
    s = SlabAllocator(arena_bytes=64 * 1024, min_slot=4096, max_slot=16384)
    assert s.slot_size(1) == 4096 and s.slot_size(4097) == 8192 and s.slot_size(16385) is None
    assert s.alloc(5000) == 8192  # no arena of that class yet: create one
    s.add_arena("a1", 8192)
    got = {s.alloc(5000) for _ in range(8)}
    assert got == {("a1", i * 8192) for i in range(8)}
    assert s.alloc(5000) == 8192  # full
    s.add_arena("a2", 8192)
    assert s.alloc(100) == 4096  # classes do not mix
    arena, off = s.alloc(8000)  # type: ignore[misc]
    assert arena == "a2"
    # Freeing the second arena's only slot releases that arena (the class keeps a1).
    assert s.free("a2", off) == "a2"


def test_leased_slot_is_not_reused_until_released() -> None:
    s = SlabAllocator(arena_bytes=8192, min_slot=4096, max_slot=4096)
    s.add_arena("a", 4096)
    one = s.alloc(10)
    two = s.alloc(10)
    assert isinstance(one, tuple) and isinstance(two, tuple)
    s.lease(*one)
    assert s.free(*one) is None
    assert s.alloc(10) == 4096, "a slot under a read lease was handed out again"
    assert s.release_lease(*one) is None
    assert s.alloc(10) == one
