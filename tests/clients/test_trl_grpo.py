"""TRL's GRPOTrainer trains through `trainer_hooks.trl` on a tiny local HF checkpoint (random
weights, the character tokenizer examples/trl_grpo.py builds): TRL's own importance-sampling ratio is 1 at identical
weights at T=0.7 and T=1, the engines hold the trainer's weights after every optimizer step, and
the manager's metrics reach the Trainer's logs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.clients, pytest.mark.timeout(600)]

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from trl_grpo import build_checkpoint  # noqa: E402  (the example's tiny checkpoint)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_grpo_trains_through_the_integration(tmp_path, temperature):
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    from rollout import InferenceConfig
    from rollout.models import load_pretrained
    from rollout.rl.manager import RolloutManager
    from rollout.rl.manager_config import RolloutManagerConfig
    from rollout.sampling import SamplingParams
    from rollout.tokenizers import load_tokenizer
    from trainer_hooks.losses import token_log_probs
    from trainer_hooks.trl import TRLRollout

    ckpt = tmp_path / "ckpt"
    build_checkpoint(ckpt)
    engine_model, _ = load_pretrained(ckpt)
    manager = RolloutManager(
        RolloutManagerConfig(), model=engine_model, tokenizer=load_tokenizer(ckpt),
        inference_config=InferenceConfig(num_blocks=128, max_sequence_length=64),
    )  # fmt: skip
    rollout = TRLRollout(manager)
    prompts = [f"{a}{b}{c}>" for a, b, c in ("abc", "xyz", "q1w", "987", "hey", "zzz")]
    dataset = datasets.Dataset.from_dict({"prompt": prompts})

    def reward(completions, **kw):  # more 'a's is better: something to learn
        assert "policy_staleness" in kw and "weight_versions" in kw  # extra fields arrive
        return [float(c.count("a")) for c in completions]

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4,
        max_completion_length=6, max_steps=3, temperature=temperature, learning_rate=3e-2,
        logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0,
        vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=10.0,
        beta=0.0, dataloader_num_workers=0, bf16=False,  # fp32 like the engine: exact ratios
    )  # fmt: skip
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    trainer = trl.GRPOTrainer(
        model=str(ckpt), reward_funcs=reward, args=args, train_dataset=dataset,
        processing_class=tok, rollout_func=rollout,
    )  # fmt: skip
    rollout.attach(trainer, importance_sampling=True)

    seen: list[dict] = []

    class EngineHoldsTrainerWeights(transformers.TrainerCallback):
        """After the rollout callback's push: a completion the engine samples carries the
        log-probs the trainer's model gives it (at the training temperature)."""

        def on_step_end(self, args, state, control, model=None, **kw):
            ids = tok("abc>")["input_ids"]
            sp = SamplingParams(temperature=temperature, num_tokens_to_generate=6,
                                ignore_eos=True, logprobs_mode="processed")  # fmt: skip
            with rollout.hooks.rollout():
                s = manager.generate([ids], sampling_params=sp)[0]
            full = torch.tensor([ids + s.completion_tokens])
            with torch.no_grad():
                logits = model(full).logits[:, len(ids) - 1 : -1].float()
            want = token_log_probs(logits, full[:, len(ids) :], temperature=temperature)[0]
            diff = (torch.tensor(s.logprobs) - want).abs().max().item()
            seen.append({"step": state.global_step, "version": manager.version, "max_diff": diff})

    trainer.add_callback(EngineHoldsTrainerWeights())
    trainer.train()
    manager.close()

    assert [s["step"] for s in seen] == [1, 2, 3]
    assert [s["version"] for s in seen] == [2, 3, 4]  # 1 at train start, +1 per step
    assert max(s["max_diff"] for s in seen) < 1e-4, seen
    logs = [h for h in trainer.state.log_history if "sampling/importance_sampling_ratio/min" in h]
    assert len(logs) == 3, trainer.state.log_history
    for h in logs:
        assert h["sampling/importance_sampling_ratio/min"] == pytest.approx(1.0, abs=1e-4), h
        assert h["sampling/importance_sampling_ratio/max"] == pytest.approx(1.0, abs=1e-4), h
        assert h["sampling/sampling_logp_difference/max"] < 1e-4
        assert "weight_sync/seconds" in h and "staleness/policy_max" in h  # on_log
        assert h["rollout/groups"] == 2.0  # 8 completions = 2 prompts x 4, each sent once


def test_the_example_runs_as_written(tmp_path):
    """examples/trl_grpo.py, as the README runs it: IS ratios 1, weights pushed every step."""
    example = Path(__file__).resolve().parents[2] / "examples" / "trl_grpo.py"
    out = subprocess.run([sys.executable, str(example), "--steps", "2"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("IS ratio [0.99") or line.startswith("IS ratio [1.00"), line
    assert "engine weight version 3" in line, line
