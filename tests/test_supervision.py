"""Supervision: dead engines restart (backoff, limit) from the last weights pushed; a hung engine
that comes back is re-admitted with the service's pause state and weights; weight updates finish
on the survivors in bounded time. Real coordinator and engine processes, tiny model."""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
import signal
import sys
import threading
import time

import pytest
import torch
from fake_engine import reap, wait_for
from near_tie import assert_greedy_agrees
from reference import tiny_model

from rollout import LLM, InferenceConfig, SamplingParams
from rollout.serving.cluster import EngineCluster
from rollout.serving.supervisor import EngineSupervisor, RestartPolicy
from rollout.serving.worker import EXIT_REFUSED, EXIT_STALE_WEIGHTS
from rollout.tokenizers import ByteTokenizer
from rollout.weights.rendezvous import COMMITTED_KEY

pytestmark = pytest.mark.timeout(240)

SP = SamplingParams(temperature=0.0, num_tokens_to_generate=6, ignore_eos=True)
PROMPTS = ["hello", "a longer prompt", [5, 6, 7, 8, 9], "xyz", "abc abc", [40, 41, 42]]
FAST = {"heartbeat_s": 0.2, "engine_timeout_s": 1.0, "policy": "round_robin"}


def _perturbed(model: torch.nn.Module, scale: float = 0.05) -> torch.nn.Module:
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(scale * torch.randn_like(p))
    return new


def _greedy(model: torch.nn.Module, prompts=PROMPTS) -> list:
    """One in-process engine's records with top-2 log-probs: the cluster batches otherwise, so
    its greedy tokens agree up to the first near tie (tests/near_tie.py)."""
    sp = SP.replace(top_n_logprobs=2)
    return LLM(model, ByteTokenizer(), InferenceConfig(num_blocks=64)).generate(prompts, sp)


# ---- the restart policy and the supervisor on plain processes -------------------------------


def test_restart_policy_backs_off():
    p = RestartPolicy(max_restarts=3, backoff_s=0.5, backoff_max_s=3.0)
    assert [p.delay(k) for k in range(4)] == [0.5, 1.0, 2.0, 3.0]
    assert RestartPolicy.of({"max_restarts": 0}).max_restarts == 0


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"max_restarts": -1}, "max_restarts"),
        ({"max_restarts": 1.5}, "max_restarts"),
        ({"window_s": 0}, "window_s"),
        ({"backoff_s": 5.0, "backoff_max_s": 1.0}, r"backoff_s \(5.0\) <= backoff_max_s"),
    ],
    ids=["negative-restarts", "float-restarts", "zero-window", "backoff-above-max"],
)
def test_restart_policy_rejects_bad_values(bad, match):
    with pytest.raises(ValueError, match=match):
        RestartPolicy(**bad)


def _exit_with(code: int) -> None:
    sys.exit(code)


def _spawn(code: int) -> mp.Process:
    """A child that exits at once with `code` (fork: no interpreter start-up per restart)."""
    proc = mp.get_context("fork").Process(target=_exit_with, args=(code,), daemon=True)
    proc.start()
    return proc


def test_supervisor_restarts_crashes_with_backoff_then_gives_up():
    """Rank 0 crashes every time: 2 restarts, then it is given up. Rank 1 exits 0 (told to
    stop): left down. Rank 2 exits stale twice, then stays up: restarted at once, not counted."""
    events: list[tuple[str, int]] = []
    stale_left = [2]

    def respawn(rank: int) -> mp.Process:
        if rank == 2:
            stale_left[0] -= 1
            return _spawn(EXIT_STALE_WEIGHTS) if stale_left[0] > 0 else _sleeper()
        return _spawn(1)

    procs = [_spawn(1), _spawn(0), _spawn(EXIT_STALE_WEIGHTS)]
    policy = RestartPolicy(max_restarts=2, window_s=60, backoff_s=0.05, backoff_max_s=0.1)
    sup = EngineSupervisor(policy, procs, respawn, lambda k, r, d: events.append((k, r)))
    sup.start()
    try:
        wait_for(lambda: sup.stats()["gave_up"] == [0], 60, "rank 0 given up")
        wait_for(lambda: sup.stats()["engines"][2]["state"] == "running", 60, "rank 2 up")
        stats = sup.stats()
        assert stats["engines"][0]["restarts"] == 2 and stats["engines"][1]["state"] == "stopped"
        assert stats["engines"][2]["restarts"] == 2 and stats["stale_restarts"] == 2
        assert [k for k, r in events if r == 0] == ["exited", "restarted"] * 2 + ["exited",
                                                                                  "gave_up"]  # fmt: skip
        assert ("restarted", 1) not in events
    finally:
        sup.stop()
        reap(procs)


def test_stale_exits_count_against_the_restart_limit():
    """An engine that exits stale every time (a committed version it can never reach) is
    restarted at once the first time, then with backoff, and given up at the limit: stale
    restarts are bounded like any other (issue 31, defect 3)."""
    events: list[tuple[str, int]] = []
    procs = [_spawn(EXIT_STALE_WEIGHTS)]
    policy = RestartPolicy(max_restarts=3, window_s=60, backoff_s=0.05, backoff_max_s=0.1)
    sup = EngineSupervisor(
        policy, procs, lambda rank: _spawn(EXIT_STALE_WEIGHTS),
        lambda k, r, d: events.append((k, r)),
    ).start()  # fmt: skip
    try:
        wait_for(lambda: sup.stats()["gave_up"] == [0], 60, "rank 0 given up")
        stats = sup.stats()
        assert stats["restarts"] == 3 and stats["stale_restarts"] == 3
        assert [k for k, _ in events] == ["exited", "restarted"] * 3 + ["exited", "gave_up"]
    finally:
        sup.stop()
        reap(procs)


def test_supervisor_gives_up_a_refused_engine_at_once():
    """An engine the coordinator refused (another model) would be refused again: no restart."""
    events: list[tuple[str, int]] = []
    procs = [_spawn(EXIT_REFUSED)]
    policy = RestartPolicy(max_restarts=5, window_s=60, backoff_s=0.05, backoff_max_s=0.1)
    sup = EngineSupervisor(
        policy, procs, lambda rank: _spawn(1), lambda k, r, d: events.append((k, r))
    )
    sup.start()
    try:
        wait_for(lambda: sup.stats()["gave_up"] == [0], 60, "rank 0 given up")
        assert sup.stats()["restarts"] == 0 and events == [("exited", 0), ("gave_up", 0)]
    finally:
        sup.stop()
        reap(procs)


def _sleep_forever() -> None:
    time.sleep(120)


def _sleeper() -> mp.Process:
    proc = mp.get_context("fork").Process(target=_sleep_forever, daemon=True)
    proc.start()
    return proc


# ---- real engines ----------------------------------------------------------------------------


@pytest.mark.heavy  # >10 s of real processes: out of the ~10-minute default suite
def test_hung_engine_is_readmitted_paused_and_restarted_when_it_missed_an_update():
    """SIGSTOP past the coordinator's engine timeout (and past the worker's own silence timeout)
    while a pause goes out; SIGCONT: the same process re-registers, adopts PAUSED, serves after
    UNPAUSE. Stopped again across a weight update: it comes back, finds it missed the update and
    is replaced by an engine with the committed weights."""
    model = tiny_model(seed=3)
    cluster = EngineCluster(
        2, model, tokenizer=ByteTokenizer(), inference_config={"num_blocks": 64},
        coordinator=FAST, restart={"backoff_s": 0.1}, sync_timeout_s=30,
        worker_options={"coordinator_timeout_s": 2.0},
    ).start()  # fmt: skip
    client = cluster.client
    try:
        hung = cluster.engine_processes[1]
        first_id = cluster.stats()["engines"][1]["engine_id"]
        os.kill(hung.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        infos = cluster.call(lambda: client.pause_engines(), 30)
        assert infos[1] == {"lost": "timed_out"}  # the pause did not wait for the hung engine
        # stopped past the worker's own 2 s silence timeout too: the silence was its own
        time.sleep(max(0.0, stopped_at + 3.0 - time.monotonic()))
        os.kill(hung.pid, signal.SIGCONT)
        wait_for(lambda: cluster.stats()["engines"].get(1, {}).get("engine_id", first_id)
                 != first_id, 30, "re-registration")  # fmt: skip
        assert hung.is_alive() and cluster.engine_processes[1] is hung  # no restart needed
        futs = cluster.call(lambda: [client.add_request(p, SP) for p in PROMPTS])
        wait_for(lambda: cluster.stats()["engines"][1]["load"].get("waiting") == 3, 30,
                 "requests waiting on the paused engine")  # fmt: skip
        assert not any(f.done() for f in futs)
        cluster.call(lambda: client.unpause_engines())
        records = cluster.call(lambda: _gather(futs), 60)
        assert_greedy_agrees([r.merge().generated_tokens for r in records], _greedy(model))

        os.kill(hung.pid, signal.SIGSTOP)
        wait_for(lambda: 1 not in cluster.stats()["engines"], 30, "hung engine dropped")
        new = _perturbed(model)
        acks = cluster.update_weights(new, 1)
        assert sorted(acks) == [0]
        os.kill(hung.pid, signal.SIGCONT)
        wait_for(lambda: cluster.stats()["engines"].get(1, {}).get("weight_version") == 1, 60,
                 "the replacement engine with version 1")  # fmt: skip
        assert cluster.supervision_stats()["stale_restarts"] == 1
        assert hung.exitcode == EXIT_STALE_WEIGHTS and cluster.engine_processes[1] is not hung
        out = cluster.call(lambda: _gather([client.add_request(p, SP) for p in PROMPTS]), 60)
        assert_greedy_agrees([r.merge().generated_tokens for r in out], _greedy(new))
        assert all(set(r.merge().generated_weight_versions) == {1} for r in out)
    finally:
        for p in cluster.engine_processes:
            if p.is_alive():
                os.kill(p.pid, signal.SIGCONT)
        cluster.close()


async def _gather(futs):
    import asyncio

    return await asyncio.gather(*futs)


@pytest.mark.heavy  # >10 s of real processes: out of the ~10-minute default suite
def test_llm_engine_killed_update_weights_completes_and_restart_serves_current_weights():
    model = tiny_model(seed=3)
    llm = LLM(model, ByteTokenizer(), InferenceConfig(num_blocks=64), use_coordinator=True,
              data_parallel_size=2, coordinator=FAST)  # fmt: skip
    cluster = llm.cluster
    try:
        v1 = _perturbed(model)
        llm.update_weights(v1, 1)
        dead = cluster.engine_processes[1]
        os.kill(dead.pid, signal.SIGKILL)
        dead.join(10)
        v2 = _perturbed(v1)
        t0 = time.monotonic()
        acks = llm.update_weights(v2, 2)  # completes on the survivor, not after a timeout
        assert time.monotonic() - t0 < cluster.sync_timeout_s / 2
        assert set(acks) <= {0, 1} and acks[0]["weight_version"] == 2
        wait_for(lambda: cluster.supervision_stats()["restarts"] == 1, 60, "restart")
        wait_for(lambda: sorted(cluster.stats()["engines"]) == [0, 1], 60, "2 engines")
        assert {e["weight_version"] for e in cluster.stats()["engines"].values()} == {2}
        out = llm.generate(PROMPTS, SP)  # round robin: both engines serve
        want, before = _greedy(v2), _greedy(v1)
        assert_greedy_agrees([r.generated_tokens for r in out], want)
        assert [r.generated_tokens for r in want] != [r.generated_tokens for r in before]
        assert all(set(r.generated_weight_versions) == {2} for r in out)
        v3 = _perturbed(v2)
        acks = llm.update_weights(v3, 3)  # later updates reach both again
        assert sorted(acks) == [0, 1]
        out = llm.generate(PROMPTS, SP)
        assert_greedy_agrees([r.generated_tokens for r in out], _greedy(v3))
    finally:
        llm.shutdown()


@pytest.mark.heavy  # >10 s of real processes: out of the ~10-minute default suite
def test_a_replayed_committed_version_does_not_loop_a_restarted_engine():
    """A local process without the secret saves the store's MACed committed version after
    update 1 and writes it back after update 2; then an engine crashes. Its restart (from the
    snapshot of version 2) is newer than the replayed value, not stale: it registers once and
    serves version 2, with one restart and none stale (issue 31, defect 3)."""
    model = tiny_model(seed=3)
    cluster = EngineCluster(
        2, model, tokenizer=ByteTokenizer(), inference_config={"num_blocks": 64},
        coordinator=FAST, restart={"backoff_s": 0.1, "max_restarts": 3}, sync_timeout_s=30,
        auth_token="replay-test-secret",
    ).start()  # fmt: skip
    try:
        cluster.update_weights(_perturbed(model), 1)
        store = cluster.sync.store
        old = store.get(COMMITTED_KEY)  # readable by anyone who reaches the store
        v2 = _perturbed(model)
        cluster.update_weights(v2, 2)
        store.set(COMMITTED_KEY, old)  # the replay: MACed by the trainer, but a rollback
        victim = cluster.engine_processes[1]
        os.kill(victim.pid, signal.SIGKILL)
        wait_for(lambda: cluster.supervision_stats()["restarts"] >= 1, 30, "a restart")
        wait_for(lambda: cluster.stats()["engines"].get(1, {}).get("weight_version") == 2, 60,
                 "the restarted engine serving version 2")  # fmt: skip
        futs = cluster.call(lambda: [cluster.client.add_request(p, SP) for p in PROMPTS])
        out = cluster.call(lambda: _gather(futs), 60)
        assert_greedy_agrees([r.merge().generated_tokens for r in out], _greedy(v2))
        sup = cluster.supervision_stats()
        assert (sup["restarts"], sup["stale_restarts"], sup["gave_up"]) == (1, 0, [])
        assert cluster.engine_processes[1].is_alive()
    finally:
        cluster.close()


def test_restart_limit_reached_leaves_the_rank_down_and_the_rest_serving():
    model = tiny_model(seed=3)
    events: list[tuple[str, int]] = []
    cluster = EngineCluster(
        2, model, tokenizer=ByteTokenizer(), inference_config={"num_blocks": 64},
        coordinator=FAST, restart={"max_restarts": 0},
        on_event=lambda k, r, d: events.append((k, r)),
    ).start()  # fmt: skip
    try:
        assert cluster.snapshot is None  # no restarts: no copy of the weights kept
        os.kill(cluster.engine_processes[0].pid, signal.SIGKILL)
        wait_for(lambda: cluster.supervision_stats()["gave_up"] == [0], 30, "give-up")
        assert events == [("exited", 0), ("gave_up", 0)]
        wait_for(lambda: sorted(cluster.stats()["engines"]) == [1], 30, "rank 0 dropped")
        out = cluster.call(lambda: _gather([cluster.client.add_request(p, SP) for p in PROMPTS]))
        assert_greedy_agrees([r.merge().generated_tokens for r in out], _greedy(model))
        acks = cluster.update_weights(_perturbed(model), 1)
        assert sorted(acks) == [1]
    finally:
        cluster.close()


@pytest.mark.heavy  # >10 s of real processes: out of the ~10-minute default suite
def test_rollout_manager_dp2_engine_killed_mid_generation_is_restarted_with_current_weights():
    from rollout.rl.manager import RolloutManager
    from rollout.rl.manager_config import RolloutManagerConfig

    model = tiny_model(seed=3)
    m = RolloutManager(
        RolloutManagerConfig(dp=2), model=model, tokenizer=ByteTokenizer(),
        inference_config=InferenceConfig(num_blocks=64, streaming_interval=4),
        cluster_options={"coordinator": FAST, "restart": {"backoff_s": 0.1}},
    )  # fmt: skip
    cluster = m.engine.cluster
    try:
        v1 = _perturbed(model)
        assert m.update_weights(v1) == 1
        long = SP.replace(num_tokens_to_generate=48)
        victim = cluster.engine_processes[0]
        killer = threading.Timer(0.0, lambda: _kill_when_busy(cluster, victim))
        killer.start()
        samples = m.generate(PROMPTS, n=2, sampling_params=long)  # nothing lost to the kill
        killer.join(30)
        assert not victim.is_alive() and all(len(s.completion_tokens) == 48 for s in samples)
        wait_for(lambda: m.stats()["engine/restarts"] == 1, 60, "the restart")
        wait_for(lambda: m.stats()["engine/num_engines"] == 2, 60, "2 engines")
        stats = m.stats()
        assert stats["engine/rank0/weight_version"] == stats["engine/rank1/weight_version"] == 1
        got = [s.completion_tokens for s in m.generate(PROMPTS, sampling_params=SP)]
        assert_greedy_agrees(got, _greedy(v1))
        v2 = _perturbed(v1)
        assert m.update_weights(v2) == 2 and sorted(m.engine.last_sync) == [0, 1]
        got = [s.completion_tokens for s in m.generate(PROMPTS, sampling_params=SP)]
        assert_greedy_agrees(got, _greedy(v2))
    finally:
        m.close()


def _kill_when_busy(cluster: EngineCluster, victim: mp.Process) -> None:
    """SIGKILL `victim` once the coordinator has requests in flight (bounded wait)."""
    wait_for(lambda: cluster.stats()["pending_requests"] > 0, 30, "requests in flight")
    os.kill(victim.pid, signal.SIGKILL)
