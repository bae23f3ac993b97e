"""Per-token staleness is exact at dp = 1, 2 and 3, against an independent oracle.

The engines are instrumented (tests/staleness_oracle.py): each logs, in its own process, every
weight update it applied and, per step, the KV positions it computed and the tokens it sampled.
From those logs alone the oracle derives how many updates each token's sampling step and its
KV's last computation had seen, and so the policy and KV staleness the trainer must receive at
hand-out. The timing is adversarial for arrival-time bookkeeping: records finish (and wait in
transit) between collect and suspend, and several updates land while records are in flight.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import staleness_oracle as oracle
import torch

from rollout.engine.worker import build_engine
from rollout.manager import RolloutManager
from rollout.models import ModelConfig, build_model
from rollout.sampling import SamplingParams
from rollout.tokenizers import ByteTokenizer

pytestmark = pytest.mark.timeout(240)

VOCAB = ByteTokenizer().vocab_size
LENGTHS = (3, 8, 13, 24)  # with a batch of 2 groups, some requests span one, two, three updates


def _icfg(num_blocks: int, kv_policy: str) -> dict:
    return {"num_blocks": num_blocks, "block_size": 4, "max_requests": 8,
            "max_tokens_per_step": 64, "max_sequence_length": 64, "streaming_interval": 2,
            "kv_policy": kv_policy}  # fmt: skip


@functools.cache
def _weights(version: int) -> dict[str, torch.Tensor]:
    return build_model(
        ModelConfig.preset("tiny", vocab_size=VOCAB), seed=100 + version
    ).state_dict()


def _prompts(lengths: tuple[int, ...] = LENGTHS, first: int = 0) -> Iterator[dict]:
    """Unique prompts (the oracle's request key), seeded, of mixed lengths."""
    for i in range(first, 10_000):
        sp = SamplingParams(
            num_tokens_to_generate=lengths[i % len(lengths)], ignore_eos=True, seed=i
        )
        yield {"prompt": [256, 1 + i % 250, 1 + i // 250, 9, 9], "sampling_params": sp}


def _manager(tmp_path, dp: int, mode: str, kv_policy: str, suspend_mode: str, num_blocks: int,
             max_staleness: int | None = None) -> RolloutManager:  # fmt: skip
    icfg = _icfg(num_blocks, kv_policy)
    common = {"mode": mode, "suspend_mode": suspend_mode, "max_staleness": max_staleness,
              "max_inflight_groups": 4 if num_blocks > 16 else 6 * dp,  # a small pool: crowd it
              "collect_timeout_s": 120.0}  # fmt: skip
    if dp == 1:
        engine = oracle.instrument(build_engine("tiny", **icfg), tmp_path / "engine-0.jsonl")
        return RolloutManager(engine=engine, **common)
    options = {
        "engine_factory": functools.partial(oracle.build_engine, str(tmp_path)),
        "coordinator": {"heartbeat_s": 0.2, "engine_timeout_s": 2.0, "block_size": 4},
    }
    return RolloutManager(model="tiny", tokenizer=None, dp=dp, inference_config=icfg,
                          cluster_options=options, **common)  # fmt: skip


def _wait_until(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _records_in_transit(m: RolloutManager) -> None:
    """dp > 1: wait until an engine has finished a request the manager has not seen yet (its
    record sits in the ClusterEngine queue), so the update lands between finish and arrival."""
    if m.config.dp > 1 and m._requests:  # engines run on until suspend: in flight will finish
        _wait_until(lambda: m.engine._results.qsize() > 0, 60, "a finished record in transit")


def _colocated(m: RolloutManager, history: list[int], steps: int) -> list:
    source, got = _prompts(), []
    for step in range(steps):
        got += [(s, len(history) - 1) for s in m.collect(source, 2)]
        _records_in_transit(m)  # the README loop with a little work before suspend
        m.suspend()
        history.append(m.update_weights(_weights(step + 1)))
        m.resume()
    return got + [(s, len(history) - 1) for s in m.collect(source, 2)]


def _async(m: RolloutManager, history: list[int], steps: int) -> list:
    source, got = _prompts(), []
    for step in range(steps):
        got += [(s, len(history) - 1) for s in m.collect(source, 2)]
        for k in range(2):  # updates in quick succession while records are in flight
            history.append(m.update_weights(_weights(2 * step + k + 1)))
    return got + [(s, len(history) - 1) for s in m.collect(source, 2)]


def _check(tmp_path, got: list, history: list[int], bound: int | None = None) -> dict:
    """Every handed-out token against the oracle; returns what the run covered."""
    requests = oracle.replay(tmp_path, history)
    seen = {"spans": 0, "kv_stale": 0, "evictions": 0, "tokens": 0}
    for s, now in got:
        assert not s.failed, s.error
        e = oracle.expected(s, requests)
        assert s.completion_tokens == e.tokens
        where = (s.request_id, s.token_times[-1] if s.token_times else None)
        assert s.token_versions == [history[u] for u in e.sampled_updates], where
        assert s.kv_versions == [history[u] for u in e.kv_updates], where
        assert s.policy_staleness == [now - u for u in e.sampled_updates], where
        assert s.kv_staleness == [now - u for u in e.kv_updates], where
        if bound is not None:
            assert s.max_policy_staleness <= bound and s.max_kv_staleness <= bound
        seen["spans"] += len(s.weight_versions) > 1
        seen["kv_stale"] += s.max_kv_staleness > 0
        seen["evictions"] += s.num_evictions
        seen["tokens"] += len(s.completion_tokens)
    return seen


CASES = [  # dp, mode, kv_policy, suspend_mode, num_blocks, max_staleness
    pytest.param(1, "colocated", "recompute", "offload", 64, None, id="dp1-colocated-recompute"),
    pytest.param(1, "colocated", "keep", "offload", 64, None, id="dp1-colocated-keep"),
    pytest.param(1, "colocated", "keep", "recompute", 8, None, id="dp1-keep-suspend_recompute-evict"),
    pytest.param(1, "async", "keep", "offload", 64, 1, id="dp1-async-keep-bound1"),
    pytest.param(2, "colocated", "keep", "offload", 64, None, id="dp2-colocated-keep"),
    pytest.param(2, "colocated", "recompute", "recompute", 8, None, id="dp2-colocated-recompute-evict"),
    pytest.param(2, "async", "keep", "offload", 64, 1, id="dp2-async-keep-bound1"),
    pytest.param(3, "colocated", "keep", "offload", 64, None, id="dp3-colocated-keep"),
    pytest.param(3, "async", "recompute", "offload", 64, None, id="dp3-async-recompute"),
]  # fmt: skip


@pytest.mark.parametrize("dp,mode,kv_policy,suspend_mode,num_blocks,bound", CASES)
def test_staleness_matches_oracle(tmp_path, dp, mode, kv_policy, suspend_mode, num_blocks, bound):
    with _manager(tmp_path, dp, mode, kv_policy, suspend_mode, num_blocks, bound) as m:
        history = [m.version]
        got = (_colocated if mode == "colocated" else _async)(m, history, steps=3)
        stats = m.stats()
    seen = _check(tmp_path, got, history, bound)
    assert len(got) == 8, len(got)
    if bound is None:
        assert seen["spans"] >= 1, seen  # partial rollouts crossed updates
    if kv_policy == "keep" and suspend_mode == "offload" and mode == "colocated":
        assert seen["kv_stale"] >= 1, seen  # KV kept across an update is counted
    if num_blocks < 16 and dp == 1:  # at dp > 1 the evicted ones may be left in flight
        assert seen["evictions"] >= 1, seen
    if bound is not None:
        assert stats["rollout/groups_dropped_stale"] >= 1  # the bound did bite
    assert stats["staleness/policy_max"] == max(max(s.policy_staleness) for s, _ in got[-2:])


def test_killed_engine_requests_are_redispatched_with_exact_staleness(tmp_path):
    """dp=3, an engine SIGKILLed while it generates: the coordinator re-dispatches its requests
    from their streamed tokens and every handed-out token still matches the oracle (the dead
    engine's log attributes the tokens it sampled before it died)."""
    with _manager(tmp_path, 3, "colocated", "keep", "offload", 64) as m:
        history = [m.version]
        got = [(s, 0) for s in m.collect(_prompts(), 2)]
        victim = m.engine.cluster.engine_processes[0]
        log = tmp_path / f"engine-{victim.pid}.jsonl"
        steps = log.read_text().count('"step"')
        batch: list = []
        errors: list = []

        def collect_more() -> None:
            try:
                batch.extend(m.collect(_prompts((40,), 100), 6))
            except Exception as e:  # reported by the main thread
                errors.append(e)

        collect = threading.Thread(target=collect_more)
        collect.start()
        _wait_until(lambda: log.read_text().count('"step"') >= steps + 4, 60, "the victim busy")
        os.kill(victim.pid, signal.SIGKILL)
        collect.join(120)
        assert not errors and len(batch) == 6, errors
        got += [(s, 0) for s in batch]
        stats = m.stats()
    assert stats["coordinator/redispatched"] >= 1
    _check(tmp_path, got, history)
