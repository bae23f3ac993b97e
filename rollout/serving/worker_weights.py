"""An engine worker's part in a weight update: release its weights on SUSPEND, join the
trainer's weight-sync group (at start, or from a rendezvous the trainer published), and receive
an update while heartbeats keep flowing (and, for a staged update, while the engine steps on
and flips between two steps)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING

from rollout.protocol import Headers
from rollout.serving.between_steps import BetweenSteps
from rollout.weights.engine_sync import EngineWeightSync
from rollout.weights.trust import weight_key

if TYPE_CHECKING:
    from rollout.serving.worker import EngineWorker

log = logging.getLogger(__name__)

# While receiving weights: how often to look for the trainer's abort of the transfer (a member
# died in it; the trainer then retries without it). The store has no push, hence a timer.
ABORT_CHECK_S = 0.2


class StaleWeights(RuntimeError):
    """The engine holds weights older than the version the trainer last committed."""


def check_committed_version(worker: EngineWorker) -> None:
    """Stale only when behind: an engine newer than the committed version (restarted from
    the snapshot of an update still being committed, or shown a replayed old value) is
    not, and restarting it would only load the same weights again."""
    if worker.sync is None:
        return
    committed = worker.sync.committed_version()
    if committed is not None and committed > worker.weight_version:
        raise StaleWeights(
            f"engine rank {worker.rank} holds weight version {worker.weight_version}, the "
            f"trainer committed {committed}: it must restart from the current weights"
        )


def release_weights(worker: EngineWorker, mode: str) -> dict:
    """SUSPEND's weights: offload or discard them (a refusal is reported in the ack)."""
    try:
        out = worker.engine.release_weights(mode)
    except (RuntimeError, ValueError) as e:
        log.warning("engine rank %d kept its weights: %s", worker.rank, e)
        return {"weights": "resident", "weights_error": str(e), "weights_bytes_freed": 0}
    worker.awaiting_weights = worker.awaiting_weights or out.get("weights") == "discarded"
    return out


def join_sync(worker: EngineWorker, rendezvous: dict | None) -> bool:
    """True when this engine takes part in weight sync: started with it, or joining now
    from the rendezvous the trainer published (an engine started on another host). A later
    trainer's rendezvous is followed by `sync.receive`, once its MAC verified."""
    if worker.sync is None and rendezvous is not None:
        host, port = rendezvous.get("host"), rendezvous.get("port")
        if not isinstance(host, str) or type(port) is not int:
            log.warning("ignoring a malformed weight-sync rendezvous: %r", rendezvous)
            return False
        timeout = rendezvous.get("timeout_s", 300.0)
        info = {"host": host, "port": port, "rank": worker.rank, "timeout_s": timeout}
        worker.sync = EngineWeightSync(worker.engine, info, weight_key(worker.auth_token))
    return worker.sync is not None


def receive_weights(worker: EngineWorker, version: int, announcement: dict | None) -> dict:
    """Take part in the trainer's broadcast of `version`: no new work is taken until the
    weights are applied or refused (InferenceConfig.weight_update="pause": no step runs
    either; "staged": the engine steps on and flips between two steps); heartbeats keep
    flowing meanwhile, and a transfer the trainer aborted (a member died) ends here at once."""
    done = threading.Event()
    out: dict = {}
    load = worker._load()

    def run() -> None:
        try:
            out.update(worker.sync.receive(version, announcement))
        finally:
            done.set()

    staged = getattr(getattr(worker.engine, "config", None), "weight_update", None) == "staged"
    worker.sync.between_steps = flips = BetweenSteps() if staged else None
    threading.Thread(target=run, name="rollout-weight-sync", daemon=True).start()
    next_hb = next_check = time.monotonic()
    while not done.is_set():
        if flips is not None and _step_while_receiving(worker, flips):
            load = worker._load()
        else:
            done.wait(ABORT_CHECK_S)
        if time.monotonic() >= next_check:
            next_check = time.monotonic() + ABORT_CHECK_S
            with contextlib.suppress(Exception):  # a store gone: the transfer fails itself
                worker.sync.watch_abort()
        if time.monotonic() >= next_hb:
            worker._send(Headers.HEARTBEAT, load)  # the coordinator must not think we died
            next_hb = time.monotonic() + worker.heartbeat_s
    if flips is not None:
        flips.run_pending()  # nothing is left waiting once the sync thread is done
    worker._last_recv = time.monotonic()
    return out


def _step_while_receiving(worker: EngineWorker, flips: BetweenSteps) -> bool:
    """A staged update: the flip when it is handed over, else one step (False: idle)."""
    if flips.run_pending():
        return True
    if worker.held or not worker.engine.has_unfinished_requests():
        return False
    worker._step()
    worker.counters["steps_while_receiving"] += 1
    return True
