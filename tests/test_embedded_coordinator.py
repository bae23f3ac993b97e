"""The coordinator a RolloutManager(dp=2) spawns is its own child: when it dies, `collect` raises
at once with an error that says so (no heartbeat timeout, no batch of failed samples), and a batch
that is mostly failed samples raises naming the reasons instead of being returned."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from rollout.config import ConfigError, load_config, validate
from rollout.config.builders import manager_config
from rollout.engine.config import InferenceConfig
from rollout.engine.interface import EngineLost
from rollout.models import build_model
from rollout.models.config import ModelConfig
from rollout.rl.batch_health import BatchFailed
from rollout.rl.manager import RolloutManager
from rollout.rl.manager_config import RolloutManagerConfig
from rollout.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)

CFG = ModelConfig.preset("tiny", vocab_size=259)
ICFG = InferenceConfig(num_blocks=256, block_size=8, max_requests=8, max_sequence_length=1024)
LONG = SamplingParams(temperature=1.0, num_tokens_to_generate=800, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, num_tokens_to_generate=4, ignore_eos=True)


@pytest.mark.parametrize("mode", ["colocated", "async"])
def test_killed_embedded_coordinator_fails_collect_within_seconds(mode):
    manager = RolloutManager(model=build_model(CFG, seed=0), dp=2, mode=mode, inference_config=ICFG)
    cluster = manager.engine.cluster
    killed_at: list[float] = []

    def kill_once_in_flight() -> None:
        deadline = time.monotonic() + 60
        while not manager.engine.has_unfinished_requests():  # collect submitted its groups
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.5)  # the engines are generating
        killed_at.append(time.monotonic())
        os.kill(cluster.coordinator_process.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_once_in_flight, daemon=True)
    try:
        killer.start()
        prompts = iter([[256, 10 + i, 20, 30] for i in range(64)])
        with pytest.raises((EngineLost, RuntimeError)) as raised:
            manager.collect(prompts, 4, n=2, sampling_params=LONG)
        seen_after = time.monotonic() - killed_at[0]
        assert "coordinator process" in str(raised.value) and "died" in str(raised.value)
        assert seen_after < 10, f"the coordinator's death was seen after {seen_after:.1f}s"
        with pytest.raises((EngineLost, RuntimeError), match="coordinator process"):
            manager.collect(prompts, 1, sampling_params=SHORT)  # and every later call
    finally:
        t0 = time.monotonic()
        manager.close()
        assert time.monotonic() - t0 < 20  # no STOP to wait for: SIGTERM at once (0.75 s here)
    assert not any(p.is_alive() for p in cluster.processes)


def _small_manager() -> RolloutManager:
    icfg = InferenceConfig(num_blocks=64, block_size=8, max_requests=8)
    return RolloutManager(model=build_model(CFG, seed=0), inference_config=icfg)


def test_mostly_failed_batch_raises_naming_the_reasons():
    bad = [10**6, 2]  # a token id outside the vocabulary: refused, a failed sample
    with _small_manager() as m:
        with pytest.raises(BatchFailed, match=r"3 of 4 samples in the batch failed") as raised:
            m.collect(iter([bad, bad, bad, [256, 5]]), 4, sampling_params=SHORT)
        assert "vocab" in str(raised.value)  # the engine's reason is named
        assert sum(raised.value.reasons.values()) == 3
        got = m.collect(iter([bad, [256, 5], [256, 6], [256, 7]]), 4, sampling_params=SHORT)
        assert [s.failed for s in got] == [True, False, False, False]  # a few: handed out


def test_max_failed_fraction_is_checked_where_it_is_set():
    with pytest.raises(ValueError, match="max_failed_fraction"):
        RolloutManagerConfig(max_failed_fraction=1.5)
    with pytest.raises(ConfigError, match=r"rollout\.max_failed_fraction"):
        validate(load_config(["rollout.max_failed_fraction=-0.1"]))
    run = validate(load_config(["rollout.max_failed_fraction=0.25"]))
    assert manager_config(run).max_failed_fraction == 0.25
