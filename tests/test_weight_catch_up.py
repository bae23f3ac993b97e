"""Engines that join after an update catch up at once, and an update survives an engine dying in
the middle of its broadcast. Real processes on loopback: `rollout serve`, `rollout engine`s that
join it, a RolloutManager attached to them.

- An engine that joins after the first update is sent the snapshot of the current version by
  the trainer's catch-up thread and takes work at that version before any further update
  (its ack's version and checksum, the coordinator's dispatch count, the samples' token versions
  and greedy parity with the reference).
- An engine SIGKILLed while the trainer is between two buckets of a broadcast: the update is
  retried on the survivor and succeeds, the next collect works at the new version, and the
  engine that comes back catches up the same way.
- Under that retry, two processes and no coordinator: the trainer's abort (the generation's
  store key plus `broadcast.Abort`) ends a receive waiting on a silent peer at once, not at the
  group's timeout, nothing is applied, and the next generation's group carries the update.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import threading
import time

import pytest
import torch
from proc_io import read_until, stop_all
from test_multihost_loopback import CMD, PROMPTS, _engine, _reference, _trainer, _weights

from rollout.rl.manager import RolloutManager
from rollout.sampling import SamplingParams
from rollout.weights.broadcast import Abort, WeightReceiver, WeightSender, WeightSyncError
from rollout.weights.rendezvous import abort_key, open_group, open_store
from rollout.weights.state import state_dict_checksum

pytestmark = pytest.mark.timeout(120)

SP = SamplingParams(temperature=0.0, num_tokens_to_generate=6, ignore_eos=True)


class Events:
    """The cluster's on_event stream; waits on a kind and rank without polling."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, dict]] = []
        self.cv = threading.Condition()

    def __call__(self, kind: str, rank: int, details: dict) -> None:
        with self.cv:
            self.seen.append((kind, rank, details))
            self.cv.notify_all()

    def wait(self, kind: str, rank: int, timeout: float = 60.0) -> dict:
        def found() -> dict | None:
            return next((d for k, r, d in self.seen if (k, r) == (kind, rank)), None)

        with self.cv:
            assert self.cv.wait_for(lambda: found() is not None, timeout), (kind, rank, self.seen)
            return found()


@pytest.fixture
def service(tmp_path):
    """`rollout serve` (engine rank 0); yields (address, env, procs): procs are stopped after."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ROLLOUT_AUTH_TOKEN": "s3"}
    serve = subprocess.Popen([*CMD, "serve", "--model", "tiny", "--dp", "1", "--policy", "round_robin"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
    procs = [serve]
    try:
        address = read_until(serve, r"coordinator (tcp://\S+) pid")[1]
        yield address, env, procs
    finally:
        stop_all(procs)


def _manager(address: str, dp: int, events: Events, sync_timeout_s: float = 20.0) -> RolloutManager:
    options = {"auth_token": "s3", "sync_timeout_s": sync_timeout_s, "on_event": events,
               "bucket_bytes": 64 << 10}  # fmt: skip
    return RolloutManager(coordinator_address=address, dp=dp, cluster_options=options)


def _assert_caught_up(manager: RolloutManager, events: Events, rank: int, version: int) -> None:
    """`rank` was sent `version` by the catch-up (no update ran meanwhile) and takes work."""
    ack = events.wait("caught_up", rank)
    assert ack["weight_version"] == version
    assert ack["checksum"] == state_dict_checksum(_trainer(version))
    assert manager.version == version  # caught up from the snapshot, not by an update
    row = manager.engine.cluster.stats()["engines"][rank]
    assert not row["syncing"] and row["weight_version"] == version
    before = row["dispatched"]
    got = manager.generate(PROMPTS * 2, sampling_params=SP)  # round robin: both engines serve
    assert [s.completion_tokens for s in got] == _reference(version) * 2
    assert all(s.weight_versions == [version] for s in got)
    assert manager.engine.cluster.stats()["engines"][rank]["dispatched"] - before == len(PROMPTS)


def test_engine_joining_after_an_update_takes_work_at_the_current_version(service):
    address, env, procs = service
    events = Events()
    with _manager(address, 1, events) as manager:
        manager.update_weights(_weights(1), 1)
        procs.append(_engine(address, 1, env))  # joins with its checkpoint's weights (version 0)
        _assert_caught_up(manager, events, 1, 1)
        counters = manager.engine.cluster.stats()["counters"]
        assert counters["engines_held_for_weights"] == counters["engines_admitted_after_sync"] == 1
        manager.update_weights(_weights(2), 2)  # later updates reach it as any member
        assert sorted(manager.engine.last_sync) == [0, 1]


def test_engine_killed_mid_broadcast_update_retries_on_the_survivor(service):
    address, env, procs = service
    procs.append(_engine(address, 1, env))
    events = Events()
    with _manager(address, 2, events) as manager:
        manager.update_weights(_weights(1), 1)
        cluster = manager.engine.cluster
        push = cluster.update_weights

        def kill_engine_1(i: int, chunk: torch.Tensor) -> None:
            if i == 2 and procs[1].poll() is None:  # between two buckets of the broadcast
                procs[1].send_signal(signal.SIGKILL)
                procs[1].wait(30)

        cluster.update_weights = lambda sd, v: push(sd, v, on_bucket=kill_engine_1)
        assert manager.update_weights(_weights(2), 2) == 2
        cluster.update_weights = push
        acks = manager.engine.last_sync
        assert sorted(acks) == [0] and acks[0]["weight_version"] == 2
        assert acks[0]["checksum"] == state_dict_checksum(_trainer(2))
        assert events.wait("left_update", 1) == {"version": 2, "attempt": 1}
        items = [{"prompt": p, "i": i} for i, p in enumerate(PROMPTS * 2)]
        batch = manager.collect(iter(items), len(PROMPTS), sampling_params=SP)
        reference = _reference(2) * 2
        assert all(s.completion_tokens == reference[s.metadata["i"]] for s in batch)
        assert all(s.token_versions == [2] * 6 and s.max_policy_staleness == 0 for s in batch)

        procs.append(_engine(address, 1, env))  # the host comes back with its initial weights
        _assert_caught_up(manager, events, 1, 2)


def test_engine_dying_before_the_group_formed_costs_no_timeout(service):
    """Engine 1 is frozen, so the update's group cannot form; then it is killed. The trainer and
    the survivor give the forming group up as soon as the coordinator drops engine 1 (not at
    the 300 s group timeout) and the retry carries the update on the survivor."""
    address, env, procs = service
    procs.append(_engine(address, 1, env))
    events = Events()
    with _manager(address, 2, events, sync_timeout_s=300.0) as manager:
        sync = manager.engine.cluster.sync
        procs[1].send_signal(signal.SIGSTOP)
        # the first update forms the group (later ones reuse it while the members stay)
        update = threading.Thread(target=manager.update_weights, args=(_weights(1), 1))
        update.start()
        deadline = time.monotonic() + 30
        while sync._abort is None or sync.sender is not None:  # the group is forming
            assert time.monotonic() < deadline, "the update never started forming its group"
            time.sleep(0.01)
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(30)
        update.join(60)
        assert not update.is_alive(), "the forming group was not given up"
        assert manager.version == 1 and sorted(manager.engine.last_sync) == [0]
        assert events.wait("left_update", 1) == {"version": 1, "attempt": 1}
        got = manager.generate(PROMPTS, sampling_params=SP)
        assert [s.completion_tokens for s in got] == _reference(1)


NUMEL = 64 << 10  # 256 KiB of float32: four 64 KiB buckets
GROUP_TIMEOUT_S = 30.0


def _receiver(port: int, out: mp.Queue) -> None:
    """An engine's side: receive generation 1 until the trainer aborts it (watched through a
    store client of its own, as a worker does), then receive generation 2."""
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=False)
    watcher = torch.distributed.TCPStore("127.0.0.1", port, is_master=False)
    abort = Abort()

    def watch() -> None:
        watcher.wait([abort_key(1)])
        abort.set()

    threading.Thread(target=watch, daemon=True).start()
    target = {"w": torch.zeros(NUMEL)}
    group = open_group("gloo", store, 1, 1, 2, GROUP_TIMEOUT_S)
    t0 = time.monotonic()
    try:
        WeightReceiver(target, group, abort=abort).receive()
        out.put("applied")
    except WeightSyncError as e:
        out.put((e.transport_broken, time.monotonic() - t0, bool(target["w"].any())))
    WeightReceiver(target, open_group("gloo", store, 2, 1, 2, GROUP_TIMEOUT_S)).receive()
    out.put(float(target["w"].sum()))


def test_trainer_abort_ends_a_receive_waiting_on_a_silent_peer_and_the_next_group_works():
    store = open_store(timeout_s=GROUP_TIMEOUT_S)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_receiver, args=(store.port, out), daemon=True)
    child.start()
    try:
        abort = Abort()
        sender = WeightSender(open_group("gloo", store, 1, 0, 2, GROUP_TIMEOUT_S),
                              bucket_bytes=64 << 10, abort=abort)  # fmt: skip

        def member_died(i: int, chunk: torch.Tensor) -> None:
            if i == 1:  # what TrainerWeightSync.abort_transfer does
                store.set(abort_key(1), "a member died")
                abort.set()

        with pytest.raises(WeightSyncError) as raised:
            sender.send({"w": torch.ones(NUMEL)}, 1, member_died)
        assert raised.value.transport_broken
        broken, seconds, changed = out.get(timeout=GROUP_TIMEOUT_S)
        assert broken and seconds < GROUP_TIMEOUT_S / 3 and not changed
        group = open_group("gloo", store, 2, 0, 2, GROUP_TIMEOUT_S)
        WeightSender(group, bucket_bytes=64 << 10).send({"w": torch.ones(NUMEL)}, 1)
        assert out.get(timeout=GROUP_TIMEOUT_S) == NUMEL
    finally:
        child.join(GROUP_TIMEOUT_S)
        if child.is_alive():
            child.kill()
