"""`EventLoopManager`: bridges synchronous callers (a trainer, a CLI) to the asyncio
`InferenceClient`: one daemon thread runs a persistent loop, coroutines are submitted to it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any


class EventLoopManager:
    """A daemon thread running one persistent asyncio loop; thread-safe entry points into it."""

    def __init__(self, name: str = "rollout-loop") -> None:
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> EventLoopManager:
        """Start the thread and its loop (idempotent; restarts after stop())."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return self
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def run() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            self._thread = threading.Thread(target=run, name=self.name, daemon=True)
            self._loop = loop
            self._thread.start()
            if not ready.wait(10):
                raise RuntimeError("event loop thread did not start within 10s")
        return self

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None or not self.running:
            raise RuntimeError("EventLoopManager is not started: call start() first")
        return self._loop

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def in_loop_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        """Schedule `coro` on the loop; the caller decides how to wait on the future."""
        try:
            loop = self.loop
        except RuntimeError:
            coro.close()
            raise
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def run_sync(self, coro: Coroutine, timeout: float | None = None) -> Any:
        """Run `coro` on the loop and block for its result (TimeoutError after `timeout`)."""
        if self.in_loop_thread():
            coro.close()
            raise RuntimeError(
                "run_sync() called from the event loop's own thread: it would wait on itself "
                "forever; use `await run_async(...)` or submit() there"
            )
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"no result from the event loop within {timeout}s") from None

    async def run_async(self, coro: Coroutine) -> Any:
        """Await `coro` running on the background loop from any other loop."""
        if self.in_loop_thread():
            return await coro
        return await asyncio.wrap_future(self.submit(coro))

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what is pending, stop the loop, join the thread (idempotent)."""
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is None or thread is None:
            return
        if thread.is_alive():

            async def cancel_all() -> None:
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

            if threading.current_thread() is not thread:
                with contextlib.suppress(Exception):
                    asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(timeout)
            loop.call_soon_threadsafe(loop.stop)
            if threading.current_thread() is not thread:
                thread.join(timeout)
        if not thread.is_alive():
            loop.close()
