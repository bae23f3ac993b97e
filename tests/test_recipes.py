"""recipes/: GRPO recipes end to end (colocated, async, Hydra multirun) on tiny sizes.

The short runs check plumbing: an offline W&B run whose history holds every namespace, the
resolved config, plots and metrics.json beside the run, weights really synced each step. The
slow test (`pytest -m slow`) checks that RL beats the warm start in the recipes as shipped.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recipes.common import ensure_override, run_recipe, sparkline
from recipes.config import lr_scheduler, rerun_may_differ, validate_recipe
from rollout.config import ConfigError, compose, load_config
from rollout.metrics import read_offline_run

ROOT = Path(__file__).resolve().parent.parent
# A few seconds per run: 2 groups x 4 samples, 3 RL steps, micro-batches of 4 (2 per step).
TINY = [
    "trainer.steps=3", "trainer.warmup_sft_steps=2", "trainer.batch=4",
    "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=6",
    "recipe.eval_every=2", "recipe.eval_prompts=4",
]  # fmt: skip
NAMESPACES = ("rollout/", "engine/", "weight_sync/", "staleness/", "train/")


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_colocated_recipe_writes_offline_wandb_run(tmp_path):
    summary = run_recipe(compose([*TINY, f"logger.dir={tmp_path}"]))
    assert summary["mode"] == "colocated" and summary["steps"] == 3
    assert summary["final_version"] == 3  # one weight update per step reached the engine
    run = read_offline_run(summary["wandb_run_dir"])
    rows = [r for r in run["history"] if "train/loss" in r]
    assert [r["_step"] for r in rows] == [0, 1, 2]
    for row in rows:
        for ns in NAMESPACES:
            assert any(k.startswith(ns) for k in row), (ns, sorted(row))
        for key in ("train/reward", "train/loss", "train/approx_kl", "train/clip_fraction",
                    "train/is_weight_mean", "rollout/tokens_per_s", "rollout/samples_per_s",
                    "rollout/time_suspended_s", "rollout/time_resumed_s", "engine/kv_bytes_freed",
                    "weight_sync/seconds", "staleness/policy_mean", "staleness/policy_max"):  # fmt: skip
            assert key in row, key
        assert row["staleness/policy_hist"]["_type"] == "histogram"
        # Batch-level staleness: the max bounds every percentile of the same tokens.
        assert row["staleness/policy_max"] >= row["staleness/policy_p99"] >= 0
        assert row["rollout/rl/samples"] == 8 and 0.0 <= row["train/reward"] <= 1.0
    assert [r["rollout/version"] for r in rows] == [1, 2, 3]
    assert rows[0]["train/eval_reward"] >= 0.0 and "train/sft_loss" in rows[0]
    assert any("train/eval_reward" in r for r in run["history"] if r["_step"] == 3)  # final eval
    # The resolved config went to W&B.
    assert run["config"]["recipe"]["name"] == "grpo_reverse"
    assert run["config"]["trainer"]["steps"] == 3
    assert run["config"]["rollout"]["mode"] == "colocated"
    for name in ("reward.png", "staleness.png", "metrics.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["summary"]["start_reward"] == pytest.approx(summary["start_reward"])
    assert len([r for r in saved["history"] if "train/loss" in r]) == 3


def test_async_recipe_trains_with_importance_correction(tmp_path):
    cfg = compose(["recipe=grpo_reverse_async", *TINY, "logger=disabled", f"logger.dir={tmp_path}"])
    assert cfg.rollout.mode == "async" and cfg.trainer.tis_cap == 2.0
    summary = run_recipe(cfg)
    assert summary["mode"] == "async" and summary["final_version"] == 3
    hist = json.loads((tmp_path / "metrics.json").read_text())["history"]
    rows = [r for r in hist if "train/loss" in r]
    assert len(rows) == 3
    for r in rows:
        assert 0.0 < r["train/is_weight_mean"] <= 2.0 and r["train/is_weight_max"] <= 2.0
        assert r["staleness/policy_max"] <= 2  # rollout.max_staleness of the async recipe
        assert "mismatch/logp_abs_diff_mean" in r
    # The engine ran ahead of the trainer: later batches hold tokens from older weights.
    assert max(r["staleness/policy_max"] for r in rows) >= 1
    assert (tmp_path / "reward.png").exists()


def test_invalid_config_fails_before_any_work(tmp_path):
    cfg = compose(
        ["rollout=async", "trainer.tis_cap=null", "logger=disabled", f"logger.dir={tmp_path}"]
    )
    with pytest.raises(ConfigError, match=r"trainer\.tis_cap"):
        run_recipe(cfg)
    assert not (tmp_path / "metrics.json").exists()


def test_hydra_multirun_from_another_directory(tmp_path):
    """`python -m recipes.grpo_reverse -m a=1,2` from outside the repo: two jobs, two outputs."""
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "recipes.grpo_reverse", "-m", "trainer.lr=0.001,0.002", *TINY,
           "trainer.steps=2", "recipe.eval_every=0", "logger=disabled", f"hydra.sweep.dir={sweep}"]  # fmt: skip
    env = {**os.environ, "WANDB_SILENT": "true"}
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lrs = []
    for job in ("0", "1"):
        saved = json.loads((sweep / job / "metrics.json").read_text())
        assert (
            saved["summary"]["steps"] == 2 and saved["config"]["recipe"]["name"] == "grpo_reverse"
        )
        lrs.append(saved["config"]["trainer"]["lr"])
        assert (sweep / job / "reward.png").exists()
    assert lrs == [0.001, 0.002]
    assert "[grpo_reverse] reward curve" in out.stdout


def test_async_entry_point_defaults_to_async_recipe(tmp_path):
    """`python -m recipes.grpo_reverse_async` picks recipe=grpo_reverse_async by itself."""
    cmd = [sys.executable, "-m", "recipes.grpo_reverse_async", *TINY, "trainer.steps=2",
           "recipe.eval_every=0", "logger=disabled", f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    env = {**os.environ, "WANDB_SILENT": "true"}
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert saved["summary"]["mode"] == "async"
    assert saved["config"]["recipe"]["name"] == "grpo_reverse_async"
    assert saved["config"]["trainer"]["tis_cap"] == 2.0


# The calculator recipe at the same tiny size: 2 groups x 4 episodes, 3 RL steps.
TINY_CALCULATOR = ["recipe=grpo_calculator", *[o for o in TINY if "max_new_tokens" not in o]]
EPISODE_KEYS = ("rollout/turns_per_episode", "rollout/tool_calls", "rollout/tool_errors",
                "rollout/kv_reuse_ratio", "staleness/turn0_policy_mean")  # fmt: skip


def test_calculator_recipe_runs_tool_episodes(tmp_path):
    """`python -m recipes.grpo_calculator trainer.steps=...` in process: episodes are collected
    and evaluated with the tool environment, their metrics logged, model tokens trained."""
    cfg = compose([*TINY_CALCULATOR, "logger=disabled", f"logger.dir={tmp_path}"])
    assert cfg.recipe.task_module == "recipes.tool_tasks" and cfg.rollout.max_turns == 3
    summary = run_recipe(cfg)
    assert summary["recipe"] == "grpo_calculator" and summary["final_version"] == 3
    hist = json.loads((tmp_path / "metrics.json").read_text())["history"]
    rows = [r for r in hist if "train/loss" in r]
    assert len(rows) == 3
    for row in rows:
        for key in EPISODE_KEYS:
            assert key in row, key
        assert row["rollout/batch_episodes"] == 8 and 1.0 <= row["rollout/turns_per_episode"] <= 3.0
        assert 0.0 <= row["rollout/tool_errors"] <= row["rollout/tool_calls"] <= 3.0
        assert row["staleness/policy_max"] <= 1 and 0.0 <= row["train/reward"] <= 1.0
    first = rows[0]
    assert {"train/eval_accuracy", "train/eval_turns", "train/eval_tool_calls"} <= set(first)
    assert 1.0 <= first["train/eval_turns"] <= 3.0
    final = [r for r in hist if r["step"] == 3 and "train/eval_accuracy" in r]
    assert final and "train/eval_sampled_tool_calls" in final[0]


@pytest.mark.parametrize("recipe", [TINY_CALCULATOR, ["recipe=grpo_reverse", *TINY]],
                         ids=["calculator", "reverse"])  # fmt: skip
def test_dynamic_sampling_option(recipe, tmp_path):
    """`rollout.dynamic_sampling=true rollout.max_extra_groups=2`: flat groups are dropped and
    replaced within the bound; the batch keeps its size; the counts are logged per step."""
    cfg = compose([*recipe, "rollout.dynamic_sampling=true", "rollout.max_extra_groups=2",
                   "logger=disabled", f"logger.dir={tmp_path}"])  # fmt: skip
    run_recipe(cfg)
    rows = [r for r in json.loads((tmp_path / "metrics.json").read_text())["history"]
            if "train/loss" in r]  # fmt: skip
    assert len(rows) == 3
    for row in rows:
        kept, filled = row["rollout/dynamic_sampling/kept"], row["rollout/dynamic_sampling/filled"]
        assert kept + filled == cfg.rollout.prompts_per_step
        assert row["rollout/dynamic_sampling/dropped"] <= 2
        assert (
            row["rollout/dynamic_sampling/oversampled"] == row["rollout/dynamic_sampling/dropped"]
        )
        assert (
            row["rollout/rl/samples"]
            == cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
        )


def docstring_commands(module: str) -> list[str]:
    """The `python -m module ...` lines of a recipe module's docstring."""
    doc = importlib.import_module(module).__doc__ or ""
    lines = [line.strip().split("  #")[0].strip() for line in doc.splitlines()]
    return [line for line in lines if line.startswith(f"python -m {module}")]


@pytest.mark.parametrize("command", docstring_commands("recipes.grpo_calculator"))
def test_calculator_docstring_commands(command, tmp_path):
    """Each command of recipes/grpo_calculator.py's docstring, as written plus tiny sizes, from
    another directory: it picks recipe=grpo_calculator by itself and trains on tool episodes."""
    words = shlex.split(command)
    multirun = "-m" in words[3:]
    tiny = [o for o in TINY_CALCULATOR if not o.startswith("recipe=")]
    out = tmp_path / "out"
    where = f"hydra.sweep.dir={out}" if multirun else f"hydra.run.dir={out}"
    cmd = [sys.executable, *words[1:], *tiny, "trainer.steps=1", "recipe.eval_every=0",
           "logger=disabled", where]  # fmt: skip
    env = {**os.environ, "WANDB_SILENT": "true"}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = sorted(out.glob("*/metrics.json")) if multirun else [out / "metrics.json"]
    assert len(runs) == (len(words[-1].split("=")[1].split(",")) if multirun else 1)
    for path in runs:
        saved = json.loads(path.read_text())
        assert saved["config"]["recipe"]["name"] == "grpo_calculator"
        assert any("rollout/tool_calls" in r for r in saved["history"])
    assert "[grpo_calculator] reward curve" in done.stdout


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (["engine.num_blocks=1", "rollout.max_new_tokens=64", "recipe.task_kwargs={min_len:2,max_len:4}"],
         ["KV pool too small", "engine.num_blocks=1", "< 70 (prompt 6 + rollout.max_new_tokens 64)"]),
        (["engine.num_blocks=5", "rollout.max_new_tokens=75"],
         ["KV pool too small", "< 81 (prompt 6 + rollout.max_new_tokens 75)"]),
        (["recipe.task=sort"], ["recipe.task='sort'", "unknown task", "reverse"]),
    ],
)  # fmt: skip
def test_task_checks(overrides, fragments):
    """The task's own checks, on top of the library's: it exists, its longest request fits."""
    with pytest.raises(ConfigError) as info:
        validate_recipe(compose(overrides))
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_lr_schedule_follows_the_config(schedule):
    """constant keeps lr; cosine falls from lr to lr * min_lr_ratio at trainer.steps and stays."""
    run = load_config([f"trainer.lr_schedule={schedule}", "trainer.steps=10", "trainer.lr=0.1",
                       "trainer.min_lr_ratio=0.2"])  # fmt: skip
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=run.trainer.lr)
    sched = lr_scheduler(run, opt)
    lrs = []
    for _ in range(12):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    if schedule == "constant":
        assert lrs == pytest.approx([0.1] * 12)
    else:
        assert lrs[0] == pytest.approx(0.1) and lrs[5] == pytest.approx(0.06)  # halfway
        assert lrs[10:] == pytest.approx([0.02, 0.02])
        assert all(a >= b for a, b in itertools.pairwise(lrs))


def without_clocks(history: list[dict]) -> list[dict]:
    """Logged rows without their clocks (durations and rates): every other value is computed
    from the data, so a bit-reproducible rerun logs it again."""
    clock = ("_s", "/seconds", "/gbps")
    return [{k: v for k, v in r.items() if not k.endswith(clock)} for r in history]


def _metrics(overrides: list[str], out_dir: Path) -> list[dict]:
    run_recipe(compose([*overrides, "logger=disabled", f"logger.dir={out_dir}",
                        f"hydra.run.dir={out_dir}"]))  # fmt: skip
    return without_clocks(json.loads((out_dir / "metrics.json").read_text())["history"])


@pytest.mark.heavy  # three runs: over 10 s
def test_a_seeded_batch_invariant_run_is_bit_reproducible(tmp_path):
    """rollout.seed with rollout.batch_invariant: a rerun logs the same value for every metric
    (rewards, losses, log-prob mismatch, evals: floats compared exactly); another seed does
    not. A KL term makes every step an optimizer step, so later steps see moved weights."""
    seeded = [*TINY, "trainer.warmup_sft_steps=300", "trainer.warmup_sft_lr=0.003",
              "trainer.kl_coef=0.01", "rollout.batch_invariant=true"]  # fmt: skip
    first = _metrics([*seeded, "rollout.seed=5"], tmp_path / "a")
    again = _metrics([*seeded, "rollout.seed=5"], tmp_path / "b")
    other = _metrics([*seeded, "rollout.seed=6"], tmp_path / "c")
    steps = [r for r in first if "train/loss" in r]
    assert len(steps) == 3 and not any(r["train/skipped_step"] for r in steps)
    assert steps[0]["mismatch/logprob_abs_diff_max"] == 0.0  # the trainer's bits, fresh tokens
    assert first == again
    assert other != first  # other draws: other rewards, lengths, losses


@pytest.mark.heavy  # two runs with engine processes
def test_a_seeded_run_on_two_engine_processes_reruns_without_partial_rollouts(tmp_path):
    """rollout.dp=2 with rollout.partial_rollouts=false: each batch is the groups sent for it, so
    a rerun logs the same values; only rollout/engine_steps, the manager's polls, may differ."""
    seeded = [*TINY, "trainer.kl_coef=0.01", "rollout.batch_invariant=true", "rollout.seed=5",
              "rollout.dp=2", "rollout.partial_rollouts=false"]  # fmt: skip
    polls = "rollout/engine_steps"
    first, again = (
        [{k: v for k, v in r.items() if k != polls} for r in _metrics(seeded, tmp_path / d)]
        for d in ("a", "b")
    )
    assert sum("train/loss" in r for r in first) == 3
    assert first == again


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        ([], None),  # unseeded: nothing promised
        (["rollout.seed=1"], None),  # seeded without the mode: nothing promised
        (["rollout.seed=1", "rollout.batch_invariant=true"], None),
        (["rollout.seed=1", "rollout.batch_invariant=true", "rollout.dp=2"], "partial_rollouts=false"),
        (["rollout.seed=1", "rollout.batch_invariant=true", "rollout.dp=2",
          "rollout.partial_rollouts=false"], None),
        (["rollout.seed=1", "rollout.batch_invariant=true", "rollout=async"], "async mode"),
    ],
)  # fmt: skip
def test_the_recipe_says_when_a_seeded_run_cannot_rerun(overrides, why):
    found = rerun_may_differ(validate_recipe(compose(overrides)))
    assert found is None if why is None else why in found


def test_rollout_seed_is_checked():
    with pytest.raises(ConfigError, match=r"rollout\.seed must be in \[0, 2\*\*31\)"):
        validate_recipe(compose(["rollout.seed=-1"]))


def test_ensure_override_and_sparkline():
    argv = ["prog", "-m", "trainer.lr=1"]
    assert ensure_override(argv, "recipe", "x") == [*argv, "recipe=x"]
    assert ensure_override(["prog", "recipe=y"], "recipe", "x") == ["prog", "recipe=y"]
    assert ensure_override(["prog", "recipe.seed=1"], "recipe", "x")[-1] == "recipe=x"
    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█"
    assert len(sparkline([0.1] * 1000, width=50)) == 50


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("recipe", ["grpo_reverse", "grpo_reverse_async"])
def test_rl_beats_the_warm_start(recipe, tmp_path):
    """The default recipes as shipped (seed 0): after the imperfect-demonstrator warm start greedy
    decoding gets at most half the strings right; GRPO raises greedy exact match by >= 0.4."""
    summary = run_recipe(compose([f"recipe={recipe}", "logger=disabled", f"logger.dir={tmp_path}"]))
    assert summary["start_eval_accuracy"] <= 0.5, summary
    assert summary["end_eval_accuracy"] >= summary["start_eval_accuracy"] + 0.4, summary
    assert summary["end_reward"] >= summary["start_reward"] + 0.4, summary  # sampled, T=1


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_rl_teaches_the_calculator_tool(tmp_path):
    """The calculator recipe as shipped (seed 0): after the warm start (a demonstrator that calls
    the tool 30% of the time) greedy decoding guesses and is rarely right; GRPO makes the tool
    call the policy and raises greedy exact answers by >= 0.4."""
    summary = run_recipe(compose(["recipe=grpo_calculator", "logger=disabled", f"logger.dir={tmp_path}"]))  # fmt: skip
    assert summary["start_eval_accuracy"] <= 0.2, summary
    assert summary["end_eval_accuracy"] >= summary["start_eval_accuracy"] + 0.4, summary
