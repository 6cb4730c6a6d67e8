"""A stand-in for ``torchvision``, put on ``sys.path`` only for the SGLang tests (never installed).

SGLang imports torchvision at module level (image processors reached through its config package), and
transformers then imports parts of it too, but the PyPI torchvision is a CUDA build that cannot load
beside the CPU torch, and the KV-cache classes under test never use it. Every module here resolves any
public name to a placeholder that raises when called, so imports succeed and any real use fails loudly.
"""

from typing import Any

__version__ = "0.0.0+tensorcast.stub"


class Unavailable:
    """What every name of the stand-in is: calling it (or reading its attributes) raises."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self.name}: torchvision is a test stand-in here")

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Unavailable(f"{self.name}.{attr}")


def placeholder(module: str, name: str) -> Any:
    """A module ``__getattr__`` body: dunder lookups (importlib's) stay real misses."""
    if name.startswith("__"):
        raise AttributeError(name)
    return Unavailable(f"{module}.{name}")


def __getattr__(name: str) -> Any:
    return placeholder(__name__, name)
