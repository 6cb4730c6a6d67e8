"""The tensor pool: memory tier (shared-memory segments and slab arenas) and disk tier, with placement.

Submodules: ``placement`` (policies, pure), ``state`` and ``slab`` (accounting and eviction decisions,
pure), ``segments``, ``memory`` and ``disk`` (the OS side). Import them directly.
"""

from tensorcast.pool.placement import PRESETS, Placement, resolve_placement

__all__ = ["PRESETS", "Placement", "resolve_placement"]
