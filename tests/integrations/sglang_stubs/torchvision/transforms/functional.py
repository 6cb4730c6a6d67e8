"""``torchvision.transforms.functional`` stand-in: importable, unusable."""

from typing import Any

from torchvision import placeholder


def __getattr__(name: str) -> Any:
    return placeholder(__name__, name)
