"""Recipes under torchrun: rank 0 owns the RolloutManager, every rank trains its share of the batch
under DDP (trainer_hooks/distributed.py), and all ranks end with the same weights.

Run as a script under torchrun (`torchrun --standalone --nproc_per_node=2 tests/test_torchrun.py
OUT`), this file checks one GRPO update done by two ranks against the same update done by one
process on the whole batch.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.common import TRAIN_KEYS, grpo_update

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
# A few seconds of recipe: 4 groups (two per rank) x 4 samples, 8 RL steps, micro-batches of 4.
# After this warm start about a third of the steps still see groups scored alike and are
# skipped (sampling is not seeded): 8 steps make "every step skipped" a ~1e-4 event.
STEPS = 8
TINY = [
    f"trainer.steps={STEPS}", "trainer.warmup_sft_steps=300", "trainer.warmup_sft_lr=0.003",
    "trainer.batch=4", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
    "rollout.max_new_tokens=6", "recipe.eval_every=2", "recipe.eval_prompts=4",
    "trainer.kl_coef=0.01",  # every step is taken: unseeded sampling may score every group alike
]  # fmt: skip
DIGEST = r"\[(\w+)\] rank (\d+)/(\d+) weights sha256 ([0-9a-f]{64})"


def torchrun(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """`torchrun ARGS` from the repository root, W&B offline; fails the test unless it exits 0."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"}
    env.pop("WANDB_API_KEY", None)
    out = subprocess.run([TORCHRUN, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=timeout)  # fmt: skip
    assert out.returncode == 0, f"{args}\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return out


def rank_digests(stdout: str, world: int) -> dict[int, str]:
    """The weights digest each rank printed; asserts every rank printed exactly one."""
    found = [(int(m[2]), int(m[3]), m[4]) for m in re.finditer(DIGEST, stdout)]
    assert sorted(r for r, _, _ in found) == list(range(world)), stdout[-3000:]
    assert all(w == world for _, w, _ in found)
    return {r: d for r, _, d in found}


def check_recipe_run(stdout: str, out_dir: Path, steps: int, world: int = 2) -> dict:
    """Rank 0 wrote metrics.json with one reward per step and pushed every update; every rank
    ended with rank 0's weights. Returns the saved metrics."""
    saved = json.loads((out_dir / "metrics.json").read_text())
    rows = [r for r in saved["history"] if "train/loss" in r]
    assert [r["step"] for r in rows] == list(range(steps))
    assert all(0.0 <= r["train/reward"] <= 1.0 for r in rows)
    assert saved["summary"]["final_version"] == steps
    digests = rank_digests(stdout, world)
    assert set(digests.values()) == {saved["summary"]["weights_sha256"]}, digests
    return saved


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dp", [1, 2], ids=["embedded", "dp2"])
@pytest.mark.heavy  # >10 s of real processes: out of the ~10-minute default suite
def test_two_ranks_train_one_model(dp, tmp_path):
    """`torchrun --nproc_per_node=2 -m recipes.grpo_reverse`: rank 0 generates (its embedded
    engine, or 2 engine processes it pushes weights to), logs one W&B run and metrics.json;
    both ranks train and end with identical weights."""
    out_dir = tmp_path / "run"
    args = ["--standalone", "--nproc_per_node=2", "-m", "recipes.grpo_reverse", *TINY,
            f"rollout.dp={dp}", f"logger.dir={out_dir}", f"hydra.run.dir={out_dir}"]  # fmt: skip
    out = torchrun(args)
    saved = check_recipe_run(out.stdout, out_dir, steps=STEPS)
    assert saved["config"]["recipe"]["name"] == "grpo_reverse"
    rows = [r for r in saved["history"] if "train/loss" in r]
    assert all(r.get("engine/num_engines", 1) == dp for r in rows)  # embedded: no such key
    assert not any(r["train/skipped_step"] for r in rows)  # every rank stepped every step
    assert len(list((out_dir / "wandb").glob("offline-run-*"))) == 1  # rank 0 alone logs
    assert out.stdout.count("[grpo_reverse] reward curve") == 1


def test_data_parallel_update_matches_one_process(tmp_path):
    """Two ranks, each with its share, take the step one process takes on the whole batch, even
    when one rank's share alone has no signal (every rank decides to step on the whole batch)."""
    result = tmp_path / "result.json"
    out = torchrun(["--standalone", "--nproc_per_node=2", __file__, str(result)])
    report = json.loads(result.read_text())
    assert report["rank0_local_signal_0"] is False and report["rank0_local_signal_1"] is True
    assert report["skipped_0"] == report["skipped_1"] == 0.0, report
    assert report["moved"] > 1e-4 and report["max_abs_diff"] < 1e-3 * report["moved"], report
    assert len(set(rank_digests(out.stdout, 2).values())) == 1


def test_torchrun_config_checks(monkeypatch):
    """Under torchrun each rank trains whole groups (prompts_per_step a multiple of the ranks)
    on its own device (no cuda:N for all); without torchrun neither applies."""
    from recipes.config import torchrun_problems
    from rollout.config import load_config

    run = load_config(["rollout.prompts_per_step=3"])
    run.model.device = "cuda:1"  # the check alone: this machine may have no CUDA to validate
    monkeypatch.setenv("WORLD_SIZE", "2")
    problems = torchrun_problems(run)
    assert len(problems) == 2, problems
    assert "prompts_per_step=3: must be a multiple of the 2 trainer ranks" in problems[0]
    assert "model.device=cuda:1" in problems[1]
    monkeypatch.delenv("WORLD_SIZE")
    assert torchrun_problems(run) == []


def _compare_update(out: Path) -> None:
    """Under torchrun: two grpo_updates by every rank on its share vs one process on the batch.
    The first batch's group 0 (rank 0's share) is scored flat, the second's is not."""
    import torch

    from rollout.config import load_config
    from rollout.config.builders import build_model_and_tokenizer
    from trainer_hooks.distributed import trainer_group

    run = load_config(["trainer.batch=2", "trainer.ppo_epochs=2", "trainer.tis_cap=2.0",
                       "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4"])  # fmt: skip
    with trainer_group(torch.device("cpu")) as group:
        assert group is not None and group.world_size == 2
        torch.manual_seed(0)
        model, tok, _ = build_model_and_tokenizer(run)
        initial = copy.deepcopy(model)
        batches = [_batch(tok.vocab_size, seed, flat_first=seed == 1) for seed in (1, 2)]
        report = _train_on_shares(group, model, batches, run)
        if group.is_main:
            reference = copy.deepcopy(initial)
            opt = torch.optim.SGD(reference.parameters(), lr=0.5)
            for batch in batches:
                grpo_update(reference, opt, batch, run)
            report.update(max_abs_diff=_max_diff(model, reference), moved=_max_diff(model, initial))
            out.write_text(json.dumps(report))


def _train_on_shares(group, model, batches, run) -> dict:
    """The data-parallel side: each rank's share of each batch, through DDP."""
    import torch

    from trainer_hooks.distributed import weights_digest

    ddp = group.wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    report = {}
    for i, batch in enumerate(batches):
        mine = group.share(batch if group.is_main else None, TRAIN_KEYS, 4)
        metrics = grpo_update(ddp, opt, mine, run, group=group)
        report[f"skipped_{i}"] = metrics["train/skipped_step"]
        report[f"rank0_local_signal_{i}"] = bool(mine["rewards"][:4].unique().numel() > 1)
    print(f"[update] rank {group.rank}/{group.world_size} weights sha256 {weights_digest(model)}",
          flush=True)  # fmt: skip
    return report


def _batch(vocab: int, seed: int, flat_first: bool) -> dict:
    """8 rows (2 groups of 4) of 12 tokens, uneven completion lengths in the two shares."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (8,), generator=g)
    completion = torch.arange(12)[None, :] >= 12 - lengths[:, None]
    rewards = torch.rand(8, generator=g)
    if flat_first:
        rewards[:4] = 0.5
    return {
        "tokens": torch.randint(0, vocab, (8, 12), generator=g),
        "completion_mask": completion,
        "behaviour_logp": -torch.rand(8, 12, generator=g) * completion,
        "policy_staleness": torch.zeros(8, 12, dtype=torch.int32),
        "rewards": rewards,
    }


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item()
               for x, y in zip(a.parameters(), b.parameters(), strict=True))  # fmt: skip


if __name__ == "__main__":
    _compare_update(Path(sys.argv[1]))
