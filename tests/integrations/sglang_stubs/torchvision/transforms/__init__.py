"""``torchvision.transforms`` stand-in: a real ``InterpolationMode`` (used in module-level tables)."""

from enum import Enum
from typing import Any

from torchvision import placeholder


class InterpolationMode(Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def __getattr__(name: str) -> Any:
    return placeholder(__name__, name)
