"""The trainer-side python blocks of "Using it": the rollout layer, routing replay, TRL, LoRA and
multi-turn episodes."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from readme_helpers import (
    ROOT,
    exec_snippet,
)

from rollout.sampling import SamplingParams


@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_trainer_snippet():
    """The trainer loop: an embedded engine, 2 steps of 16 groups x 8 samples, weights synced."""
    import copy
    import itertools

    from rollout import InferenceConfig
    from rollout.models import ModelConfig, build_model
    from rollout.rl.samples import collate
    from rollout.tokenizers import ByteTokenizer
    from trainer_hooks.losses import sequence_log_probs

    tok = ByteTokenizer()
    policy = build_model(ModelConfig.preset("tiny", vocab_size=tok.vocab_size), seed=0)

    def grpo_loss(model, groups):
        batch = collate(groups, tok.pad_id)
        mask = batch["completion_mask"]
        return -sequence_log_probs(model(batch["tokens"]), batch["tokens"], mask).sum() / mask.sum()

    names = dict(
        policy=policy, policy_copy=copy.deepcopy(policy), tok=tok, steps=2, grpo_loss=grpo_loss,
        icfg=InferenceConfig(max_sequence_length=64), reward=lambda s: float(len(s.completion_tokens) % 2),
        dataset=itertools.cycle(["12>", "345>", "6789>"]),
        opt=torch.optim.SGD(policy.parameters(), lr=1e-3),
    )  # fmt: skip
    ns = exec_snippet("### As a trainer's rollout layer", names)
    groups, manager = ns["groups"], ns["manager"]
    try:
        assert len(groups) == 16 * 8 and all(
            len(s.logprobs) == len(s.completion_tokens) for s in groups
        )
        assert manager.version == 2
    finally:
        manager.close()


def test_routing_replay_snippet():
    """The routing-replay block on a tiny Qwen3-MoE: samples from a manager that records."""
    transformers = pytest.importorskip("transformers")
    from rollout.models import from_transformers
    from rollout.rl.manager import RolloutManager
    from rollout.rl.manager_config import RolloutManagerConfig
    from rollout.tokenizers import ByteTokenizer

    tok = ByteTokenizer()
    cfg = transformers.Qwen3MoeConfig(vocab_size=tok.vocab_size, hidden_size=32,
                                      intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=16)  # fmt: skip
    hf_model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    model, _ = from_transformers(hf_model)
    sp = SamplingParams(num_tokens_to_generate=4)
    with RolloutManager(RolloutManagerConfig(routing_replay=True), model=model, tokenizer=tok) as m:
        samples = m.generate(["ab", "cde"], n=2, sampling_params=sp)
    ns = exec_snippet("### Routing replay for MoE models (R3)", dict(samples=samples,
                                                                       hf_model=hf_model))  # fmt: skip
    assert ns["batch"]["routed_experts"].shape[2:] == (2, 2)
    assert ns["logits"].shape[:2] == ns["batch"]["tokens"].shape


@pytest.mark.clients
@pytest.mark.timeout(300)
def test_trl_snippet(tmp_path):
    """The TRL block: 2 GRPO steps on a tiny checkpoint, weights pushed after each."""
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    import datasets
    import trl
    from transformers import AutoTokenizer

    sys.path.insert(0, str(ROOT / "examples"))
    from trl_grpo import build_checkpoint

    from rollout.models import load_pretrained
    from rollout.rl.manager import RolloutManager
    from rollout.rl.manager_config import RolloutManagerConfig
    from rollout.tokenizers import load_tokenizer

    ckpt = tmp_path / "ckpt"
    build_checkpoint(ckpt)
    defaults = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
                    num_generations=4, max_completion_length=4, max_steps=2, report_to=[],
                    use_cpu=True, save_strategy="no")  # fmt: skip
    names = dict(
        ckpt=ckpt, load_pretrained=load_pretrained, RolloutManager=RolloutManager,
        RolloutManagerConfig=RolloutManagerConfig, load_tokenizer=load_tokenizer,
        GRPOTrainer=trl.GRPOTrainer, GRPOConfig=lambda *_, **kw: trl.GRPOConfig(**{**defaults, **kw}),
        reward=lambda completions, **kw: [float(len(c)) for c in completions],
        dataset=datasets.Dataset.from_dict({"prompt": ["abc>", "xyz>"]}),
        tokenizer=AutoTokenizer.from_pretrained(ckpt),
    )  # fmt: skip
    ns = exec_snippet("### TRL's GRPOTrainer", names)
    try:
        assert ns["trainer"].state.global_step == 2
        assert ns["manager"].version == 3  # train start + one push per step
    finally:
        ns["manager"].close()


def test_lora_snippet():
    """The LoRA block: 2 steps of a PEFT-wrapped Qwen3, each pushing the adapter alone."""
    ns = exec_snippet(
        "### LoRA: push the adapter, not the merged model", {"print": lambda *a: None}
    )
    manager, policy = ns["manager"], ns["policy"]
    assert manager.version == 2
    adapter = sum(p.numel() * 4 for n, p in policy.named_parameters() if "lora_" in n)
    scales = sum("lora_A" in n for n, _ in policy.named_parameters())  # one fp32 per module
    assert manager.stats()["weight_sync/bytes"] == adapter + 4 * scales  # the scale travels too
    assert adapter < sum(p.numel() * 4 for p in policy.parameters()) / 5


def test_episode_snippet():
    """The multi-turn example: 4 groups x 4 episodes of the guessing game, masks and turns."""
    from rollout import InferenceConfig
    from rollout.models import ModelConfig, build_model
    from rollout.tokenizers import ByteTokenizer

    tok = ByteTokenizer()
    policy = build_model(ModelConfig.preset("tiny", vocab_size=tok.vocab_size), seed=0)
    names = dict(policy_copy=policy, tok=tok, icfg=InferenceConfig(max_sequence_length=128))
    ns = exec_snippet("### Multi-turn, tool-using episodes", names)
    episodes, manager = ns["episodes"], ns["manager"]
    try:
        assert len(episodes) == 16 and not any(s.failed for s in episodes)
        assert all(1 <= len(s.turns) <= 4 for s in episodes)
        assert any(0 in s.loss_mask for s in episodes)  # some guess missed: an observation
        assert all(s.finish_reason in ("done", "max_turns") for s in episodes)
    finally:
        manager.close()
