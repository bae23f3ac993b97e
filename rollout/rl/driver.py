"""`EngineDriver`: who touches the engine, and when (the threading half of RolloutManager).

- colocated: the caller's thread drives the engine inline; `wait` steps it until done.
- async: one background thread owns the engine and keeps stepping it while requests are in
  flight. Every call from the trainer (update_weights, suspend, ...) is a command the thread runs
  between two engine steps, so a weight swap can never land inside a forward pass and no lock can
  starve the trainer.

The owner's state (groups, requests) is guarded by `cv`, the driver's condition variable, which
the owner notifies when a result a waiter may want has arrived. Work that arrives from another
thread (the next turn of an episode whose environment answered) is queued with `submit`; while
such work may still come (`elsewhere()`), an idle engine is waited on, not an error.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from rollout.engine.interface import EngineProtocol


class _Closed(RuntimeError):
    pass


class EngineDriver:
    """Runs engine work with exclusive access: inline, or between two steps of the async thread.

    `step` is the owner's "one engine step and its finished records"; `suspended` is set by the
    owner (inside a command) while the engine's memory is released: it is never stepped then.
    """

    def __init__(
        self,
        engine: EngineProtocol,
        step: Callable[[], None],
        timeout_s: float,
        background: bool,
        elsewhere: Callable[[], bool] = lambda: False,
    ) -> None:
        self.engine = engine
        self._step = step
        self._elsewhere = elsewhere  # work in progress off the engine that will submit more
        self.timeout_s = timeout_s
        self.cv = threading.Condition()
        self.suspended = False
        self.closed = False
        self._error: BaseException | None = None
        self._commands: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self.thread: threading.Thread | None = None
        if background:
            self.thread = threading.Thread(target=self._run, name="rollout-async", daemon=True)
            self.thread.start()

    def stop(self) -> None:
        """Stop the async thread (it finishes its current step) and fail queued commands."""
        if self.thread is not None and self.thread.is_alive():
            with self.cv:
                self.closed = True
                self.cv.notify_all()
            self.thread.join(timeout=30)
        self.closed = True
        with self.cv:
            for _fn, fut in self._commands:
                fut.set_exception(_Closed("RolloutManager closed"))
            self._commands.clear()
            self.cv.notify_all()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` with exclusive access to the engine: inline, or between two async steps."""
        if self.closed:
            raise RuntimeError("RolloutManager is closed")
        if self.thread is None:
            return fn()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self.cv:
            if self._error is not None:
                raise RuntimeError(f"rollout thread failed: {self._error}") from self._error
            self._commands.append((fn, fut))
            self.cv.notify_all()
        self.engine.wake()  # a cluster engine blocks in step() waiting for records
        return fut.result(timeout=self.timeout_s)

    def call_later(self, fn: Callable[[], Any]) -> None:
        """Queue engine work from inside a `cv` section (runs before the next step)."""
        self._commands.append((fn, concurrent.futures.Future()))
        self.cv.notify_all()

    def submit(self, fn: Callable[[], Any]) -> None:
        """Queue engine work from any thread; it runs before the next step (colocated: the next
        time the trainer's thread drives the engine)."""
        with self.cv:
            if self.closed:
                return
            self.call_later(fn)
        self.engine.wake()

    def wait(self, done: Callable[[], bool]) -> None:
        """Block until `done()` (called under `cv`): drive the engine inline, or wait for the
        async thread."""
        if self.thread is None:
            self._drive_until(done)
            return
        with self.cv:
            self.cv.notify_all()
            ok = self.cv.wait_for(
                lambda: done() or self._error is not None or self.closed or self.suspended,
                timeout=self.timeout_s,
            )
            if not done() and self.suspended:
                raise RuntimeError("RolloutManager is suspended: call resume() before generating")
            if self._error is not None:
                raise RuntimeError(f"rollout thread failed: {self._error}") from self._error
            if self.closed:
                raise RuntimeError("RolloutManager closed while waiting")
            if not ok:
                raise TimeoutError(f"no result within {self.timeout_s}s")

    def _drive_until(self, done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            self._run_commands()
            with self.cv:
                if done():
                    return
            if self.suspended:
                raise RuntimeError("RolloutManager is suspended: call resume() before generating")
            if not self.engine.has_unfinished_requests():
                self._wait_elsewhere(done, deadline)
            else:
                self._step()
            if time.monotonic() > deadline:
                raise TimeoutError(f"no result within {self.timeout_s}s")

    def _wait_elsewhere(self, done: Callable[[], bool], deadline: float) -> None:
        """The engine is idle: wait for work from another thread (an environment's answer)."""
        with self.cv:
            if not self._elsewhere():
                raise RuntimeError("engine idle but the requested samples never finished")
            self.cv.wait_for(
                lambda: self._commands or done() or not self._elsewhere(),
                timeout=max(0.0, deadline - time.monotonic()),
            )

    def _run_commands(self) -> None:
        while True:
            with self.cv:
                if not self._commands:
                    return
                fn, fut = self._commands.popleft()
            try:
                fut.set_result(fn())
            except BaseException as e:
                fut.set_exception(e)

    def _run(self) -> None:
        """Async mode: the only thread that touches the engine."""
        try:
            while True:
                self._run_commands()
                with self.cv:
                    if self.closed:
                        return
                    busy = not self.suspended and self.engine.has_unfinished_requests()
                    if not busy and not self._commands:
                        self.cv.wait()
                        continue
                if busy:
                    self._step()
        except BaseException as e:
            with self.cv:
                self._error = e
                for _, fut in self._commands:
                    fut.set_exception(e)
                self._commands.clear()
                self.cv.notify_all()
