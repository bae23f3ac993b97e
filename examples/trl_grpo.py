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
import torch
import transformers
import trl
from transformers import AutoTokenizer

from rollout import InferenceConfig
from rollout.models import load_pretrained
from rollout.rl.manager import RolloutManager
from rollout.rl.manager_config import RolloutManagerConfig
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


CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 >")
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]


def build_checkpoint(path: Path) -> None:
    """A character-level HF tokenizer and a random tiny Llama, in HF layout."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])  # fmt: skip
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    hf_tok.save_pretrained(path)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # peaked enough that T=0.7 and T=1 differ clearly
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.save_pretrained(path)


def _tiny_checkpoint(path: Path) -> Path:
    if not (path / "config.json").is_file():
        build_checkpoint(path)
    return path


if __name__ == "__main__":
    main(sys.argv[1:])
