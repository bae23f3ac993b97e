"""`BetweenSteps`: a worker's staged weight update, received on one thread, flipped on the loop.

With `InferenceConfig(weight_update="staged")` an engine process keeps stepping while its
weight-sync thread receives and verifies the next version (`EngineWeightSync`, every check of
the weight path: MACs, checksums, all-or-nothing) and stages it (`rollout.engine.staging`).
Only the flip must run on the thread that steps the engine, between two steps: the sync thread
hands it over here and waits for it; the worker's loop runs it before its next step. The ack
(the model's checksum and the digest of what was received) is made after the flip, as for a
plain update.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any


class BetweenSteps:
    """Work that the sync thread needs done on the engine's thread, between two steps."""

    def __init__(self) -> None:
        self._pending: queue.SimpleQueue[tuple[Callable[[], Any], threading.Event, dict]] = (
            queue.SimpleQueue()
        )

    def __call__(self, fn: Callable[[], Any]) -> Any:
        """From the sync thread: run `fn` on the engine's thread; its result, or its error."""
        done, box = threading.Event(), {}
        self._pending.put((fn, done, box))
        done.wait()
        if "error" in box:
            raise box["error"]
        return box.get("result")

    def run_pending(self) -> bool:
        """From the engine's thread, between two steps: run what was handed over (True if any)."""
        ran = False
        while True:
            try:
                fn, done, box = self._pending.get_nowait()
            except queue.Empty:
                return ran
            try:
                box["result"] = fn()
            except BaseException as e:  # reported to the sync thread, which fails the update
                box["error"] = e
            finally:
                done.set()
            ran = True
