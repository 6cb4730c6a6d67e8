"""Worker process: roles basic (memory tier) and gateway (callers' entry point)."""

from tensorcast.worker.server import Worker, run_worker

__all__ = ["Worker", "run_worker"]
