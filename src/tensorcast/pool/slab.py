"""Slab allocation of small objects inside large arena segments (pure bookkeeping).

Owns: size classes (powers of two from ``min_slot`` to ``max_slot``), which arena serves which class,
free slots, and slots that must not be reused yet because a reader still holds them (the zero-copy
invariant: memory being read is never handed out for other bytes). Returns decisions — "use slot X",
"create an arena of class C", "this arena is empty, release it" — and never touches memory itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Slab", "SlabAllocator"]


@dataclass
class Slab:
    arena_id: str
    slot_size: int
    nslots: int
    free: list[int] = field(default_factory=list)  # slot indexes

    @property
    def used(self) -> int:
        return self.nslots - len(self.free)


class SlabAllocator:
    def __init__(self, arena_bytes: int, min_slot: int = 4096, max_slot: int = 1024 * 1024) -> None:
        if arena_bytes < max_slot:
            raise ValueError("an arena must hold at least one slot of the largest class")
        self.arena_bytes = arena_bytes
        self.min_slot = min_slot
        self.max_slot = max_slot
        self.slabs: dict[str, Slab] = {}
        self._by_class: dict[int, list[str]] = {}
        self._leased: dict[tuple[str, int], int] = {}  # (arena, slot) -> readers
        self._free_when_released: set[tuple[str, int]] = set()

    def slot_size(self, nbytes: int) -> int | None:
        """The class for an object, or None if it is too big for arenas."""
        if nbytes > self.max_slot:
            return None
        return max(self.min_slot, 1 << (max(nbytes, 1) - 1).bit_length())

    def alloc(self, nbytes: int) -> tuple[str, int] | int:
        """``(arena_id, offset)``; or the slot size of an arena the caller must create (``add_arena``)."""
        size = self.slot_size(nbytes)
        assert size is not None
        for aid in self._by_class.get(size, ()):
            slab = self.slabs[aid]
            if slab.free:
                return aid, slab.free.pop() * size
        return size

    def add_arena(self, arena_id: str, slot_size: int) -> None:
        nslots = self.arena_bytes // slot_size
        self.slabs[arena_id] = Slab(arena_id, slot_size, nslots, list(range(nslots - 1, -1, -1)))
        self._by_class.setdefault(slot_size, []).append(arena_id)

    def lease(self, arena_id: str, offset: int) -> None:
        key = (arena_id, offset)
        self._leased[key] = self._leased.get(key, 0) + 1

    def release_lease(self, arena_id: str, offset: int) -> str | None:
        """End a read lease; returns an arena id to release if that freed the arena's last slot."""
        key = (arena_id, offset)
        self._leased[key] -= 1
        if self._leased[key] == 0:
            del self._leased[key]
            if key in self._free_when_released:
                self._free_when_released.discard(key)
                return self._do_free(arena_id, offset)
        return None

    def free(self, arena_id: str, offset: int) -> str | None:
        """Free a slot (deferred while leased); returns an arena id to release if it became empty."""
        if (arena_id, offset) in self._leased:
            self._free_when_released.add((arena_id, offset))
            return None
        return self._do_free(arena_id, offset)

    def _do_free(self, arena_id: str, offset: int) -> str | None:
        slab = self.slabs[arena_id]
        slab.free.append(offset // slab.slot_size)
        if slab.used == 0 and len(self._by_class[slab.slot_size]) > 1:
            self._by_class[slab.slot_size].remove(arena_id)
            del self.slabs[arena_id]
            return arena_id
        return None
