"""A worker the coordinator forgot (it was frozen past the engine timeout) joins again cleanly:
errors answering frames it sent before re-registering are stale, not a refusal, and it adopts
the service's lifecycle state before it takes work. Real coordinator and sockets, fake engine."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine, Harness, wait_for, wait_until

from rollout.protocol import Headers
from rollout.serving.worker import EngineWorker

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("state", ["PAUSED", "SUSPENDED"])
async def test_forgotten_worker_ignores_stale_errors_and_adopts_state(state):
    h = Harness()  # engine_timeout_s=1.0
    client = await h.client()
    engine = FakeEngine()
    worker = EngineWorker(engine, h.address, 0, auth_token=h.auth_token)
    try:
        worker.register()
        wait_for(lambda: len(h.coord.engines) == 1, 5, "registration")
        await client.pause_engines()  # goes out after the engine froze: it never sees it
        if state == "SUSPENDED":
            await client.suspend_engines("recompute")
        # "frozen": no heartbeats; the coordinator forgets the engine after its timeout
        wait_for(lambda: not h.coord.engines, 10, "the coordinator forgetting the engine")
        # frames sent before the worker learns it was forgotten: each gets "unknown peer"
        worker._send(Headers.HEARTBEAT, {})
        worker._send(Headers.HEARTBEAT, {})
        worker.running = True
        # the first error -> register(); the second one arrives meanwhile and is stale
        wait_for(lambda: _drained(worker) and len(h.coord.engines) == 1, 5, "re-registration")
        assert h.coord.counters["engines_registered"] == 2
        assert worker.paused
        assert (worker.suspended is not None) == (state == "SUSPENDED")
        assert (engine.suspended is not None) == (state == "SUSPENDED")
        if state == "SUSPENDED":
            await client.resume_engines()
        await client.unpause_engines()
        wait_for(lambda: _drained(worker) and not worker.paused, 5, "unpause reaching the worker")
        assert worker.suspended is None and engine.suspended is None
    finally:
        worker.running = False
        worker.close()
        client.stop()
        h.close()


def _drained(worker: EngineWorker) -> bool:
    worker._drain()
    return True


class _SyncStub:
    """A weight-sync worker whose trainer has committed nothing yet: its own version stands."""

    def committed_version(self) -> None:
        return None

    def receive(self, version: int, announcement: dict | None) -> dict:  # one it declines
        return {"weight_version": 0, "error": "declined"}

    def close(self) -> None:
        pass


@pytest.mark.parametrize("managed", [False, True], ids=["label-only", "weight-sync"])
async def test_rejoining_worker_adopts_a_relabel_it_missed(managed):
    """`rollout serve` versions are labels: one SET_WEIGHT_VERSION reaches the worker, the next
    lands while it is frozen. When it joins again it takes the coordinator's label from the
    registration ack (and reports it in its heartbeats); a weight-sync worker keeps the version
    of the weights it holds (its committed-version check decides, exit code 3)."""
    h = Harness()  # engine_timeout_s=1.0
    client = await h.client()
    worker = EngineWorker(FakeEngine(), h.address, 0, auth_token=h.auth_token)
    worker.sync = _SyncStub() if managed else None
    try:
        worker.register()
        wait_for(lambda: len(h.coord.engines) == 1, 5, "registration")
        worker.running = True
        relabel = client.set_weight_version(5)
        await wait_until(lambda: _drained(worker) and relabel.done(), 5, "the first relabel")
        assert worker.weight_version == (0 if managed else 5)
        await wait_until(lambda: not h.coord.engines, 10, "the coordinator forgetting the engine")
        await client.set_weight_version(7)  # no live engine: the frozen one never sees it
        worker._send(Headers.HEARTBEAT, {})  # answered "unknown peer": it registers again
        wait_for(lambda: _drained(worker) and len(h.coord.engines) == 1, 5, "re-registration")
        assert h.coord.counters["engines_registered"] == 2
        assert worker.weight_version == (0 if managed else 7)
        worker._next_hb = 0.0
        worker._heartbeat()
        engine = next(iter(h.coord.engines.values()))
        await wait_until(lambda: engine.weight_version == worker.weight_version, 5, "the label")
        stats = await client.stats()
        assert stats["weight_version"] == 7
        assert stats["engines"][0]["weight_version"] == (0 if managed else 7)
    finally:
        worker.running = False
        worker.sync = None
        worker.close()
        client.stop()
        h.close()
