"""`EngineDriver`: who touches the engine, and when (the threading half of RolloutManager).

- colocated: the caller's thread drives the engine inline; `_wait` steps it until done.
- async: one background thread owns the engine and keeps generating. Every call from the trainer
  (update_weights, suspend, ...) is a command the thread runs between two engine steps, so a
  weight swap can never land inside a forward pass and no lock can starve the trainer.

A mixin: the host provides `engine`, `config.collect_timeout_s`, `_suspended`, `_closed` and the
generation hooks below (`_refill`, `_step`, `_exhausted`, `_can_refill`); all shared state is
guarded by `_cv`.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any


class _Closed(RuntimeError):
    pass


class EngineDriver:
    """Runs engine work with exclusive access: inline, or between two steps of the async thread."""

    engine: Any
    config: Any
    _suspended: bool
    _closed: bool

    def _init_driver(self) -> None:
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self._commands: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self._thread: threading.Thread | None = None

    def _start_thread(self) -> None:
        """Async mode: hand the engine to the background thread."""
        self._thread = threading.Thread(target=self._run, name="rollout-async", daemon=True)
        self._thread.start()

    def _stop_driver(self) -> None:
        """Stop the async thread (it finishes its current step) and fail queued commands."""
        if self._thread is not None and self._thread.is_alive():
            with self._cv:
                self._closed = True
                self._cv.notify_all()
            self._thread.join(timeout=30)
        self._closed = True
        with self._cv:
            for _fn, fut in self._commands:
                fut.set_exception(_Closed("RolloutManager closed"))
            self._commands.clear()
            self._cv.notify_all()

    # ------------------------------------------------------------------ hooks (the host's)

    def _refill(self) -> None:
        """Submit more work from the prompt source, if any is due."""
        raise NotImplementedError

    def _step(self) -> None:
        """One engine step, and its finished records."""
        raise NotImplementedError

    def _exhausted(self) -> bool:
        """Nothing more can become ready (called under `_cv`)."""
        raise NotImplementedError

    def _can_refill(self) -> bool:
        """The prompt source has work to submit now (called under `_cv`)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ commands

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` with exclusive access to the engine: inline, or between two async steps."""
        if self._closed:
            raise RuntimeError("RolloutManager is closed")
        if self._thread is None:
            return fn()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._error is not None:
                raise RuntimeError("rollout thread failed") from self._error
            self._commands.append((fn, fut))
            self._cv.notify_all()
        wake = getattr(self.engine, "wake", None)
        if wake is not None:  # a cluster engine blocks in step() waiting for records
            wake()
        return fut.result(timeout=self.config.collect_timeout_s)

    def _call_later(self, fn: Callable[[], Any]) -> None:
        """Queue engine work from inside a `_cv` section (runs before the next step)."""
        self._commands.append((fn, concurrent.futures.Future()))
        self._cv.notify_all()

    def _run_commands(self) -> None:
        while True:
            with self._cv:
                if not self._commands:
                    return
                fn, fut = self._commands.popleft()
            try:
                fut.set_result(fn())
            except BaseException as e:
                fut.set_exception(e)

    def _wait(self, done: Callable[[], bool]) -> None:
        """Block until `done()`: drive the engine inline, or wait for the async thread."""
        deadline = time.monotonic() + self.config.collect_timeout_s
        if self._thread is None:
            while True:
                self._run_commands()
                with self._cv:
                    if done():
                        return
                if self._suspended:
                    raise RuntimeError(
                        "RolloutManager is suspended: call resume() before generating"
                    )
                self._refill()
                if not self.engine.has_unfinished_requests():
                    with self._cv:
                        if done() or self._exhausted():
                            return
                    raise RuntimeError("engine idle but the requested samples never finished")
                self._step()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no result within {self.config.collect_timeout_s}s")
        with self._cv:
            self._cv.notify_all()
            ok = self._cv.wait_for(
                lambda: done() or self._error is not None or self._closed or self._suspended,
                timeout=self.config.collect_timeout_s,
            )
            if not done() and self._suspended:
                raise RuntimeError("RolloutManager is suspended: call resume() before generating")
            if self._error is not None:
                raise RuntimeError("rollout thread failed") from self._error
            if self._closed:
                raise RuntimeError("RolloutManager closed while waiting")
            if not ok:
                raise TimeoutError(f"no result within {self.config.collect_timeout_s}s")

    def _run(self) -> None:
        """Async mode: the only thread that touches the engine."""
        try:
            while True:
                self._run_commands()
                with self._cv:
                    if self._closed:
                        return
                    busy = not self._suspended and (
                        self.engine.has_unfinished_requests() or self._can_refill()
                    )
                    if not busy and not self._commands:
                        self._cv.wait()
                        continue
                if busy:
                    self._refill()
                    if self.engine.has_unfinished_requests():
                        self._step()
        except BaseException as e:
            with self._cv:
                self._error = e
                for _, fut in self._commands:
                    fut.set_exception(e)
                self._commands.clear()
                self._cv.notify_all()
