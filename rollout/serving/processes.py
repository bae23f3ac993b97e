"""Child processes that die with their parent.

Every child (coordinator, engine workers) watches a pipe from the parent and exits when it
closes, so nothing survives a parent that crashed or was killed; `stop_processes` joins, then
escalates to SIGTERM and SIGKILL. Child entrypoints install `exit_on_signal` for SIGTERM so that
a stop unwinds through their `finally` blocks (sockets closed, schedule log written).

Standard library only: the coordinator process imports it and must stay free of torch.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any


def _watch_parent(conn: Any, grace_s: float = 10.0) -> None:
    """Block on a pipe from the parent; EOF means the parent is gone: stop, then force."""
    with contextlib.suppress(EOFError, OSError):
        conn.recv()
    os.kill(os.getpid(), signal.SIGTERM)  # the clean path: entrypoints turn it into SystemExit
    time.sleep(grace_s)  # only reached if the main thread is stuck in C code (a collective)
    os._exit(1)


def _child_main(watch: Any, target: Callable[..., Any], args: tuple) -> None:
    threading.Thread(target=_watch_parent, args=(watch,), daemon=True).start()
    target(*args)


def exit_on_signal(signum: int, frame: Any) -> None:
    """SIGTERM handler of child entrypoints: a clean SystemExit(0) instead of dying mid-write."""
    raise SystemExit(0)


def spawn_child(target: Callable[..., Any], args: tuple, name: str) -> mp.Process:
    """Start `target(*args)` in a spawned process that exits when this process dies."""
    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_main, args=(reader, target, args), daemon=True, name=name)
    proc.start()
    reader.close()
    proc._rollout_lifeline = writer  # type: ignore[attr-defined]  # closed with the process
    return proc


def stop_processes(procs: list[mp.Process], timeout_s: float = 10.0) -> None:
    """Join, then SIGTERM, then SIGKILL: every process is gone when this returns."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + timeout_s / 2
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5)
        lifeline = getattr(p, "_rollout_lifeline", None)
        if lifeline is not None:
            lifeline.close()
