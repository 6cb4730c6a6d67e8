"""An asyncio event loop on a thread of its own, for synchronous facades and embedded runtimes.

Owns: creating the loop (uvloop where installed), running coroutines on it from other threads, and
stopping it. The synchronous client, the instance runtime and the command line use it. Does not own:
what runs on the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread", "new_event_loop"]

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


class LoopThread:
    def __init__(self, name: str = "tensorcast-client") -> None:
        self.loop = new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.submit(coro).result()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("synchronous TensorCast call made from its own event loop thread")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        if not self.thread.is_alive():
            self.loop.close()
