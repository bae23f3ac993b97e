"""`ProcessWatch`: hear that a child process died the moment it does.

A thread blocks on the process's sentinel (no polling, no heartbeat timeout): the embedded
coordinator is the trainer's own child, so its death is known at once, not after the client's
heartbeat timeout, and whoever waits on it is told (`EngineCluster` fails its work with an
error that says so).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class ProcessWatch:
    """Calls `on_exit(exitcode)` on its own thread when `proc` exits, unless `stop()`ped first."""

    def __init__(self, proc: mp.Process, on_exit: Callable[[int | None], None]) -> None:
        self.proc = proc
        self.on_exit = on_exit
        self._stopped = threading.Event()
        self._wake_r, self._wake_w = mp.Pipe(duplex=False)
        self._thread = threading.Thread(target=self._run, name=f"watch-{proc.name}", daemon=True)

    def start(self) -> ProcessWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        """No call after this (a teardown stops the process on purpose); idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._wake_w.send_bytes(b"")
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        if not self._thread.is_alive():
            self._wake_r.close()
            self._wake_w.close()

    def _run(self) -> None:
        ready = mp.connection.wait([self.proc.sentinel, self._wake_r])
        if self._stopped.is_set() or self.proc.sentinel not in ready:
            return
        self.proc.join(1.0)  # the sentinel fired: reaping is quick
        try:
            self.on_exit(self.proc.exitcode)
        except Exception:  # a listener's bug must not go unseen
            log.exception("handling the exit of %s failed", self.proc.name)
