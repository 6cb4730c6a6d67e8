from __future__ import annotations

import pytest

from tensorcast.errors import InvalidArgument
from tensorcast.pool.placement import PRESETS, Placement, resolve_placement


def test_presets_and_their_promises() -> None:
    assert resolve_placement(None).name == "cache"
    assert set(PRESETS) == {"cache", "durable", "ha", "cold", "warm", "pinned"}
    assert resolve_placement("durable").disk == "required"
    assert resolve_placement("ha").replicas == 2
    assert resolve_placement("warm").overflow == "reject" and resolve_placement("warm").evictable
    assert not resolve_placement("pinned").evictable and resolve_placement("pinned").memory == "required"
    assert resolve_placement("cold", cold_memory_ttl=5.0).memory_ttl == 5.0
    with pytest.raises(InvalidArgument, match="presets"):
        resolve_placement("fast")


@pytest.mark.parametrize("bad", [
    Placement(memory="none", disk="none"),
    Placement(replicas=0),
    Placement(memory="none", disk="required", replicas=2),
    Placement(memory="required", overflow="spill"),
    Placement(memory_ttl=5.0),
    Placement(overflow="later"),  # type: ignore[arg-type]
])
def test_general_form_is_validated(bad: Placement) -> None:
    with pytest.raises(InvalidArgument):
        resolve_placement(bad)
