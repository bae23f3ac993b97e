"""Multi-turn episodes through the RolloutManager with the real engine: token-in/token-out,
loss masks, concurrency while an environment waits, failure isolation, per-token versions
across turns and weight updates (replayed through the trainer's model), dynamic sampling."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from reference import greedy, tiny_model

from rollout.engine.config import InferenceConfig
from rollout.rl.environment import Environment, EnvStep
from rollout.rl.episodes import episode_metrics
from rollout.rl.manager import RolloutManager
from rollout.rl.samples import NO_VERSION, collate
from rollout.sampling import SamplingParams
from trainer_hooks.losses import sequence_log_probs

TURN_TOKENS = 5
OBS = [[40, 41, 42], [50, 51, 52, 53], [60, 61], [70], [80, 81]]


class Scripted(Environment):
    """Prompt = the example's tokens; observation k = OBS[k]; done after `turns` model turns;
    reward = 1 per turn."""

    def __init__(self, example: dict) -> None:
        self.example = example
        self.turns_seen: list[list[int]] = []

    async def reset(self, example: dict) -> list[int]:
        return list(example["prompt_ids"])

    async def step(self, turn: list[int]) -> EnvStep:
        self.turns_seen.append(turn)
        k = len(self.turns_seen)
        done = k >= self.example.get("turns", 3)
        return EnvStep(observation=[] if done else OBS[k - 1], reward=1.0, done=done,
                       info={"tool_calls": 1.0})  # fmt: skip


def _greedy_sp(n: int = TURN_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, num_tokens_to_generate=n, ignore_eos=True)


def _icfg(**kw) -> InferenceConfig:
    base = dict(num_blocks=256, block_size=8, max_requests=16, max_tokens_per_step=256)
    return InferenceConfig(**(base | kw))


def _examples(k: int, turns: int = 3) -> list[dict]:
    return [
        {"prompt_ids": [1 + i, 2, 3, 4, 5, 6, 7 + i, 8, 9, 10], "turns": turns} for i in range(k)
    ]


def test_episode_is_one_token_list_with_masks_and_exact_greedy_turns(model):
    with RolloutManager(model=model, inference_config=_icfg()) as m:
        samples = m.generate(_examples(3), n=1, sampling_params=_greedy_sp(), env=Scripted)
    for ex, s in zip(_examples(3), samples, strict=True):
        assert not s.failed and s.finish_reason == "done" and s.reward == 3.0
        assert s.prompt_tokens == ex["prompt_ids"]
        context, expected, mask = list(ex["prompt_ids"]), [], []
        for k in range(3):  # the plain no-cache decode of the growing episode
            turn = greedy(model, context, TURN_TOKENS)
            obs = OBS[k] if k < 2 else []
            expected += turn + obs
            mask += [1] * len(turn) + [0] * len(obs)
            context += turn + obs
        assert s.completion_tokens == expected
        assert s.loss_mask == mask
        assert [t.start for t in s.turns] == [0, 8, 17]
        assert [t.context_tokens for t in s.turns] == [10, 18, 27]
        obs_at = [i for i, bit in enumerate(mask) if not bit]
        assert all(s.logprobs[i] == 0.0 and s.token_versions[i] == NO_VERSION for i in obs_at)
        assert all(s.logprobs[i] < 0.0 for i, bit in enumerate(mask) if bit)
        assert s.env_info == {"tool_calls": 3.0}
        # KV reused: every complete block the previous turn computed (its last token was
        # sampled, never fed back), block size 8
        assert [t.cached_tokens for t in s.turns] == [0, 8, 16]
    batch = collate(samples)
    assert int(batch["completion_mask"].sum()) == 3 * 3 * TURN_TOKENS
    metrics = episode_metrics(samples)
    assert metrics["rollout/turns_per_episode"] == 3.0
    assert metrics["rollout/tool_calls"] == 3.0


def test_episodes_wait_on_environments_concurrently(model):
    """Episode 0's environment blocks until episode 1 has finished: possible only if the other
    episodes keep generating while one waits."""
    released = threading.Event()

    class Blocking(Scripted):
        async def step(self, turn: list[int]) -> EnvStep:
            if self.example["id"] == 0 and not self.turns_seen:
                await asyncio.to_thread(released.wait, 30)
            out = await super().step(turn)
            if self.example["id"] == 1 and out.done:
                released.set()
            return out

    items = [dict(ex, id=i) for i, ex in enumerate(_examples(2))]
    with RolloutManager(model=model, inference_config=_icfg()) as m:
        samples = m.generate(items, sampling_params=_greedy_sp(), env=Blocking)
    assert released.is_set()
    assert [s.finish_reason for s in samples] == ["done", "done"]


class Faulty(Scripted):
    async def step(self, turn: list[int]) -> EnvStep:
        mode = self.example.get("fault")
        if mode == "raise":
            raise RuntimeError("tool crashed")
        if mode == "garbage":
            return EnvStep(observation=["not", "ids"])  # type: ignore[list-item]
        if mode == "hang":
            await asyncio.Event().wait()
        if mode == "vocab":
            return EnvStep(observation=[10**6])
        if mode == "info":
            return EnvStep(observation=[1], info={"tool_calls": "one"})  # type: ignore[dict-item]
        return await super().step(turn)


@pytest.mark.parametrize("fault", ["raise", "garbage", "hang", "vocab", "info"])
def test_a_failing_environment_fails_its_episode_alone(model, fault):
    items = [dict(ex, fault=None) for ex in _examples(3)]
    items[1]["fault"] = fault
    with RolloutManager(model=model, inference_config=_icfg(), env_timeout_s=1.0) as m:
        samples = m.collect(iter(items), 3, n=1, sampling_params=_greedy_sp(), env=Faulty)
        stats = m.stats()
    bad = [s for s in samples if s.metadata["fault"]]
    good = [s for s in samples if not s.metadata["fault"]]
    assert len(bad) == 1 and bad[0].failed and bad[0].reward == 0.0
    assert {"raise": "tool crashed", "garbage": "token ids", "hang": "exceeded", "vocab": "turn 1", "info": "EnvStep.info"}[fault] in bad[0].error  # fmt: skip
    assert all(not s.failed and s.reward == 3.0 for s in good)
    assert stats["rollout/episodes_failed"] == 1


def test_limits_end_episodes(model):
    with RolloutManager(model=model, inference_config=_icfg(), max_turns=2) as m:
        (s,) = m.generate(_examples(1), sampling_params=_greedy_sp(), env=Scripted)
    assert s.finish_reason == "max_turns" and len(s.turns) == 2
    with RolloutManager(model=model, inference_config=_icfg(), max_episode_tokens=20) as m:
        (s,) = m.generate(_examples(1), sampling_params=_greedy_sp(), env=Scripted)
    assert s.finish_reason == "max_tokens" and s.num_tokens == 20
    assert len(s.turns) == 2 and s.turns[1].num_tokens == 20 - 10 - 5 - 3


def _weights(version: int) -> dict[str, torch.Tensor]:
    base = tiny_model(seed=3).state_dict()
    g = torch.Generator().manual_seed(version)
    out = {k: v + 0.02 * version * torch.randn(v.shape, generator=g) for k, v in base.items()}
    out["lm_head.weight"] = out["model.embed_tokens.weight"]  # tied: one tensor, one value
    return out


@pytest.mark.parametrize("mode", ["colocated", "async"])
def test_episodes_across_weight_updates_replay_through_the_trainer(mode):
    """Oracle: every model token's behaviour log-prob equals the trainer model's, at the token's
    own recorded version, over the episode's whole token list; observation tokens are never
    counted; staleness is the number of updates since that version."""
    engine_model = tiny_model(seed=3)
    sp = SamplingParams(temperature=1.0, num_tokens_to_generate=6, ignore_eos=True, seed=7)
    # Short and long episodes alternate: the long ones are still going at each update.
    source = iter([{"prompt_ids": [5 + i, 9, 11, 13, 17, 19], "turns": 2 + 3 * (i // 2 % 2)}
                   for i in range(24)])  # fmt: skip
    kept = []
    with RolloutManager(model=engine_model, inference_config=_icfg(), mode=mode,
                        max_inflight_groups=4) as m:  # fmt: skip
        for version in range(1, 4):
            m.resume()
            kept += [(s, m.version) for s in m.collect(source, 2, n=2, sampling_params=sp, env=Scripted)]  # fmt: skip
            m.suspend()
            m.update_weights(_weights(version), version)
    assert any(len(set(s.weight_versions)) > 1 for s, _ in kept), "no episode crossed an update"
    trainer = tiny_model(seed=3)
    for s, now in kept:  # staleness counts the updates up to hand-out
        assert not s.failed
        tokens = torch.tensor([s.prompt_tokens + s.completion_tokens])
        p = len(s.prompt_tokens)
        for v in sorted(set(s.weight_versions)):
            trainer.load_state_dict(_weights(v))
            with torch.no_grad():
                mask = torch.zeros_like(tokens, dtype=torch.bool)
                mask[0, p:] = True
                logp = sequence_log_probs(trainer(tokens), tokens, mask)[0, p:]
            for i, (bit, tv) in enumerate(zip(s.loss_mask, s.token_versions, strict=True)):
                if bit and tv == v:
                    assert abs(float(logp[i]) - s.logprobs[i]) < 1e-4, (s.request_id, i, v)
        for bit, tv, pol in zip(s.loss_mask, s.token_versions, s.policy_staleness, strict=True):
            assert (tv == NO_VERSION) == (not bit)
            assert pol == (now - tv if bit else 0)


def test_dynamic_sampling_drops_flat_groups_and_keeps_the_batch_full(model):
    """Odd prompts: every sample scores the same (dropped); even prompts: rewards differ."""
    items = iter([{"prompt": [1, 2, 3, 4 + i], "k": i} for i in range(40)])

    def reward(s):
        return 1.0 if s.metadata["k"] % 2 else float(s.index)

    sp = SamplingParams(num_tokens_to_generate=3, ignore_eos=True)
    with RolloutManager(model=model, inference_config=_icfg(), dynamic_sampling=True,
                        max_inflight_groups=4) as m:  # fmt: skip
        batch = m.collect(items, 4, n=2, reward_fn=reward, sampling_params=sp)
        stats = m.stats()
    ks = sorted({s.metadata["k"] for s in batch})
    assert len(batch) == 8 and all(k % 2 == 0 for k in ks)
    assert stats["rollout/groups_dropped_zero_variance"] >= 3
    assert stats["rollout/dynamic_sampling/kept"] == 4
    assert (
        stats["rollout/dynamic_sampling/dropped"] == stats["rollout/groups_dropped_zero_variance"]
    )


def test_dynamic_sampling_fills_the_batch_past_its_bound(model):
    items = iter([{"prompt": [1, 2, 3, 4 + i]} for i in range(40)])
    sp = SamplingParams(num_tokens_to_generate=2, ignore_eos=True)
    with RolloutManager(model=model, inference_config=_icfg(), dynamic_sampling=True,
                        max_extra_groups=2) as m:  # fmt: skip
        batch = m.collect(items, 3, n=2, reward_fn=lambda s: 0.5, sampling_params=sp)
        stats = m.stats()
    assert len(batch) == 6
    assert stats["rollout/groups_dropped_zero_variance"] == 2
    assert stats["rollout/dynamic_sampling/filled"] == 3


def test_dynamic_sampling_needs_rewards(model):
    with (
        RolloutManager(model=model, inference_config=_icfg(), dynamic_sampling=True) as m,
        pytest.raises(ValueError, match="reward_fn"),
    ):
        m.collect(iter([[1, 2, 3]]), 1, n=2)


def test_episode_and_dynamic_sampling_options_reach_the_manager():
    from rollout.config import ConfigError, load_config
    from rollout.config.builders import manager_config

    run = load_config(["rollout.dynamic_sampling=true", "rollout.max_extra_groups=5",
                       "rollout.max_turns=3", "rollout.env_timeout_s=2.5"])  # fmt: skip
    cfg = manager_config(run)
    assert (cfg.dynamic_sampling, cfg.max_extra_groups, cfg.max_turns) == (True, 5, 3)
    assert cfg.env_timeout_s == 2.5
    assert cfg.max_episode_tokens == run.engine.max_sequence_length
    with pytest.raises(ConfigError, match=r"rollout\.max_episode_tokens"):
        load_config(["rollout.max_episode_tokens=100000"])
    with pytest.raises(ConfigError, match=r"rollout\.max_turns"):
        load_config(["rollout.max_turns=0"])


def test_grpo_loss_trains_the_model_turns_only():
    """The gradient reaches the logits that predict model tokens and none that predict
    observation, prompt or padding tokens."""
    from trainer_hooks.loop import grpo_loss

    policy = tiny_model(seed=5)
    sp = SamplingParams(temperature=1.0, num_tokens_to_generate=4, ignore_eos=True, seed=1)
    with RolloutManager(model=policy, inference_config=_icfg()) as m:
        samples = m.collect(iter(_examples(2)), 2, n=2, reward_fn=lambda s: float(s.index),
                            sampling_params=sp, env=Scripted)  # fmt: skip
    captured = {}

    def forward(tokens: torch.Tensor) -> torch.Tensor:
        logits = policy(tokens)
        logits.retain_grad()
        captured["logits"] = logits
        return logits

    loss, _ = grpo_loss(_Forward(forward, policy), samples, n=2)
    loss.backward()
    grad = captured["logits"].grad[:, :-1].abs().sum(-1)  # position t predicts token t + 1
    trained = collate(samples)["completion_mask"][:, 1:]
    assert bool((grad[~trained] == 0).all())
    assert bool((grad[trained] > 0).all())


class _Forward(torch.nn.Module):
    """`fn` as a module whose parameters are `owner`'s (grpo_loss asks for the device)."""

    def __init__(self, fn, owner: torch.nn.Module) -> None:
        super().__init__()
        self.fn, self.owner = fn, owner

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.fn(tokens)


def test_stale_episodes_are_regenerated_from_the_start():
    engine_model = tiny_model(seed=3)
    sp = SamplingParams(temperature=1.0, num_tokens_to_generate=4, ignore_eos=True, seed=3)
    source = iter([{"prompt_ids": [5 + i, 9, 11, 13], "turns": 2 + 3 * (i // 2 % 2)}
                   for i in range(24)])  # fmt: skip
    with RolloutManager(model=engine_model, inference_config=_icfg(), max_inflight_groups=4,
                        max_staleness=0, stale_policy="regenerate") as m:  # fmt: skip
        m.collect(source, 2, n=2, sampling_params=sp, env=Scripted)
        m.update_weights(_weights(1), 1)
        batch = m.collect(source, 4, n=2, sampling_params=sp, env=Scripted)  # + the leftovers
        regenerated = m.stats()["rollout/samples_regenerated"]
    assert regenerated > 0
    assert all(s.weight_versions == [1] and s.max_policy_staleness == 0 for s in batch)
    assert all(not s.failed for s in batch)


def test_turns_reuse_no_kv_without_the_prefix_cache_or_across_an_update(model):
    with RolloutManager(model=model, inference_config=_icfg(enable_prefix_caching=False)) as m:
        (s,) = m.generate(_examples(1), sampling_params=_greedy_sp(), env=Scripted)
    assert [t.cached_tokens for t in s.turns] == [0, 0, 0]

    class UpdateBetweenTurns(Scripted):
        async def step(self, turn):
            if not self.turns_seen:  # the engine's weights change while the episode waits here
                await asyncio.to_thread(manager.update_weights, _weights(1), 1)
            return await super().step(turn)

    with RolloutManager(
        model=tiny_model(seed=3), inference_config=_icfg(), mode="async"
    ) as manager:
        (s,) = manager.generate(_examples(1), sampling_params=_greedy_sp(), env=UpdateBetweenTurns)
    assert [t.cached_tokens for t in s.turns] == [0, 0, 16]  # stale blocks are never reused
    assert s.weight_versions == [0, 1]


def test_episode_turns_stay_on_their_engine_at_dp2():
    """Round robin would alternate a turn's engine; the episode's routing key keeps every turn
    where its KV is, so every later turn reuses it."""
    icfg = dict(num_blocks=256, block_size=8, max_requests=16, max_tokens_per_step=256)
    options = {"coordinator": {"policy": "round_robin"}}
    with RolloutManager(model="tiny", dp=2, inference_config=icfg, cluster_options=options) as m:
        samples = m.generate(_examples(6), sampling_params=_greedy_sp(), env=Scripted)
    for s in samples:
        assert not s.failed and len(s.turns) == 3
        assert [t.cached_tokens for t in s.turns] == [0, 8, 16]


def test_kv_reuse_benchmark_runs_and_computes_fewer_tokens(tmp_path):
    from benchmarks.multiturn_kv_reuse import main

    result = main(quick=True, out_dir=tmp_path)
    assert result["same_episodes"] and result["ratios"]["tokens_computed"] < 0.6
    reuse = result["kv_reuse"]
    assert reuse["tokens_reused"] == reuse["turn_cached_tokens"] > 0
    assert (tmp_path / "multiturn_kv_reuse.json").exists()
    assert (tmp_path / "multiturn_kv_reuse.png").exists()
