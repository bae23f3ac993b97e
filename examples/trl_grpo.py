"""TRL's GRPOTrainer generating through rollout (trainer_hooks.trl), on a local HF checkpoint.

    python examples/trl_grpo.py                 # builds a tiny random checkpoint in ./tiny_ckpt
    python examples/trl_grpo.py --model DIR     # any Llama/Qwen2 checkpoint with a tokenizer

The engine gets its own copy of the weights; the callback pushes the trainer's after every
optimizer step, and TRL's importance-sampling correction compares its log-probs with the
engine's behaviour log-probs (processed, at GRPOConfig.temperature): `sampling/*` in the logs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import datasets
import trl
from transformers import AutoTokenizer

from rollout import InferenceConfig
from rollout.models import load_pretrained
from rollout.rl.manager import RolloutManager, RolloutManagerConfig
from rollout.tokenizers import load_tokenizer
from trainer_hooks.trl import TRLRollout


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: a tiny random one)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--temperature", type=float, default=0.7)
    args = p.parse_args(argv)
    ckpt = Path(args.model) if args.model else _tiny_checkpoint(Path("tiny_ckpt"))

    engine_model, _ = load_pretrained(ckpt)  # the engine's copy
    manager = RolloutManager(
        RolloutManagerConfig(logprobs_mode="processed"),  # TRL's convention (the default)
        model=engine_model,
        tokenizer=load_tokenizer(ckpt),
        inference_config=InferenceConfig(max_sequence_length=128),
    )
    rollout = TRLRollout(manager)
    dataset = datasets.Dataset.from_dict({"prompt": [f"{i:03d}>" for i in range(64)]})

    def reward(completions, **kwargs):  # toy reward: more 'a's
        return [float(c.count("a")) for c in completions]

    config = trl.GRPOConfig(
        output_dir="trl_grpo_out", per_device_train_batch_size=8, num_generations=4,
        max_completion_length=8, max_steps=args.steps, temperature=args.temperature,
        learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no",
        bf16=False,  # the engine runs fp32 here: bf16 autocast would make the IS ratios drift
        vllm_importance_sampling_mode="token_truncate",
    )  # fmt: skip
    trainer = trl.GRPOTrainer(
        model=str(ckpt), reward_funcs=reward, args=config, train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(ckpt), rollout_func=rollout,
    )  # fmt: skip
    rollout.attach(trainer)  # callback first; TRL's IS correction on
    trainer.train()
    manager.close()
    last = [h for h in trainer.state.log_history if "sampling/importance_sampling_ratio/max" in h][-1]  # fmt: skip
    print(f"IS ratio [{last['sampling/importance_sampling_ratio/min']:.6f}, "
          f"{last['sampling/importance_sampling_ratio/max']:.6f}]; engine weight version "
          f"{last['rollout/version']:.0f}; policy staleness max {last['staleness/policy_max']:.0f}")  # fmt: skip


def _tiny_checkpoint(path: Path) -> Path:
    """A character tokenizer and a random 2-layer Llama in HF layout (what the tests build)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "clients"))
    from test_trl_grpo import build_checkpoint

    build_checkpoint(path)
    return path


if __name__ == "__main__":
    main(sys.argv[1:])
