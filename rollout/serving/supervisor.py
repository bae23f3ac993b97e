"""`EngineSupervisor`: restarts engine processes that die, with backoff and a limit.

A thread blocks on the engine processes' sentinels (no polling). An engine that exits with code 0
was told to stop and stays down. Every other exit restarts it after `backoff_s * 2**k` (k = its
restarts within the last `window_s`, capped at `backoff_max_s`), unless it already restarted
`max_restarts` times within `window_s`: then it stays down, and the supervisor reports it as
given up (the others keep serving). One that exits with `EXIT_STALE_WEIGHTS`, or that the
cluster retired after a weight update it missed, did nothing wrong: its first restart in the
window is immediate, but it counts like any other, so nothing (a forged or replayed committed
version in the weight store, say) can make an engine restart forever.
One the coordinator refused (`EXIT_REFUSED`: another model than the service's) is given up at
once: the same process would be refused again.
The callback that builds the new process decides what it loads (the cluster's latest weights).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rollout.serving.worker import EXIT_REFUSED, EXIT_STALE_WEIGHTS

log = logging.getLogger(__name__)

RETIRE_GRACE_S = 10.0  # a retired engine gets this long to exit on SIGTERM, then SIGKILL


@dataclass(frozen=True)
class RestartPolicy:
    """How dead engines come back. `max_restarts=0` turns restarts off."""

    max_restarts: int = 5  # per engine within window_s
    window_s: float = 600.0
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int):
            raise ValueError(f"max_restarts must be an int >= 0, got {self.max_restarts!r}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not self.window_s > 0:
            raise ValueError(f"restart window_s must be > 0, got {self.window_s!r}")
        if not 0 <= self.backoff_s <= self.backoff_max_s:
            raise ValueError(f"need 0 <= backoff_s ({self.backoff_s!r}) <= backoff_max_s "
                             f"({self.backoff_max_s!r})")  # fmt: skip

    @classmethod
    def of(cls, value: RestartPolicy | Mapping[str, Any] | None) -> RestartPolicy:
        if value is None:
            return cls()
        return value if isinstance(value, cls) else cls(**dict(value))

    def delay(self, recent: int) -> float:
        return min(self.backoff_max_s, self.backoff_s * 2.0**recent)


Event = Callable[[str, int, dict], None]  # (kind, rank, details): exited | restarted | gave_up


class EngineSupervisor:
    """Watches `processes` (indexed by rank, replaced in place on restart)."""

    def __init__(
        self,
        policy: RestartPolicy,
        processes: list[mp.Process],
        respawn: Callable[[int], mp.Process],
        on_event: Event | None = None,
    ) -> None:
        self.policy = policy
        self.processes = processes
        self.respawn = respawn
        self.on_event = on_event
        self.restarts = [0] * len(processes)
        self.stale_restarts = 0
        self.gave_up: set[int] = set()
        self.stopped: set[int] = set()  # exited 0: told to stop
        self._history: list[list[float]] = [[] for _ in processes]  # restart times
        self._due: dict[int, float] = {}  # rank -> when to restart
        self._retiring: dict[int, float] = {}  # rank -> when to SIGKILL
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake_r, self._wake_w = mp.Pipe(duplex=False)
        self._thread = threading.Thread(target=self._run, name="rollout-supervisor", daemon=True)

    # ---- control --------------------------------------------------------------------------

    def start(self) -> EngineSupervisor:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop restarting (teardown); idempotent."""
        self._stop.set()
        self._wake()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def retire(self, rank: int) -> None:
        """Replace rank's engine now (it holds weights it must not serve): SIGTERM, restart."""
        with self._lock:
            proc = self.processes[rank]
            if not proc.is_alive() or rank in self._retiring:
                return
            self._retiring[rank] = time.monotonic() + RETIRE_GRACE_S
        proc.terminate()
        self._wake()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "restarts": sum(self.restarts),
                "stale_restarts": self.stale_restarts,
                "gave_up": sorted(self.gave_up),
                "engines": {r: {"restarts": n, "pid": self.processes[r].pid,
                                "state": self._state(r)}
                            for r, n in enumerate(self.restarts)},
            }  # fmt: skip

    def _state(self, rank: int) -> str:
        if rank in self.gave_up:
            return "gave_up"
        if rank in self.stopped:
            return "stopped"
        if rank in self._due:
            return "restarting"
        return "running" if self.processes[rank].is_alive() else "exited"

    # ---- the watch loop -------------------------------------------------------------------

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send_bytes(b"")

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            for rank in [r for r, t in self._due.items() if t <= now]:
                self._restart(rank)
            for rank in [r for r, t in self._retiring.items() if t <= now]:
                if self.processes[rank].is_alive():
                    self.processes[rank].kill()
            watched = {
                self.processes[r].sentinel: r
                for r in range(len(self.processes))
                if r not in self._due and r not in self.gave_up and r not in self.stopped
            }
            deadlines = [*self._due.values(), *self._retiring.values()]
            timeout = max(0.0, min(deadlines) - now) if deadlines else None
            ready = mp.connection.wait([*watched, self._wake_r], timeout)
            for obj in ready:
                if obj is self._wake_r:
                    with contextlib.suppress(EOFError, OSError):
                        while self._wake_r.poll():
                            self._wake_r.recv_bytes()
                elif not self._stop.is_set():
                    self._exited(watched[obj])

    def _exited(self, rank: int) -> None:
        proc = self.processes[rank]
        proc.join(5.0)  # the sentinel fired: it has exited, reaping is quick
        code = proc.exitcode
        lifeline = getattr(proc, "_rollout_lifeline", None)
        if lifeline is not None:
            lifeline.close()
        now = time.monotonic()
        retired = self._retiring.pop(rank, None) is not None
        self._emit("exited", rank, {"pid": proc.pid, "exitcode": code})
        stale = retired or code == EXIT_STALE_WEIGHTS
        with self._lock:
            if code == 0 and not retired:
                self.stopped.add(rank)
                return
            history = self._history[rank]
            history[:] = [t for t in history if now - t < self.policy.window_s]
            if len(history) >= self.policy.max_restarts or code == EXIT_REFUSED:
                self.gave_up.add(rank)
            else:
                self.stale_restarts += stale
                first_stale = stale and not history
                self._due[rank] = now + (0.0 if first_stale else self.policy.delay(len(history)))
                history.append(now)
        if rank in self.gave_up:
            log.error("engine rank %d exited (code %s) after %d restarts within %.0fs: giving up",
                      rank, code, len(self._history[rank]), self.policy.window_s)  # fmt: skip
            self._emit("gave_up", rank, {"exitcode": code, "restarts": self.restarts[rank]})
        else:
            log.warning("engine rank %d exited (code %s); restarting in %.1fs", rank, code,
                        self._due[rank] - now)  # fmt: skip

    def _restart(self, rank: int) -> None:
        try:
            proc = self.respawn(rank)
        except Exception as e:  # e.g. the coordinator is gone: nothing to restart into
            log.error("engine rank %d could not be restarted: %s", rank, e)
            with self._lock:
                self._due.pop(rank, None)
                self.gave_up.add(rank)
            self._emit("gave_up", rank, {"error": str(e), "restarts": self.restarts[rank]})
            return
        with self._lock:
            self._due.pop(rank, None)
            self.processes[rank] = proc
            self.restarts[rank] += 1
        self._emit("restarted", rank, {"pid": proc.pid, "restarts": self.restarts[rank]})

    def _emit(self, kind: str, rank: int, details: dict) -> None:
        if self.on_event is None:
            return
        try:
            self.on_event(kind, rank, details)
        except Exception:  # a reporting callback must not stop the supervision
            log.exception("supervisor event callback failed")
