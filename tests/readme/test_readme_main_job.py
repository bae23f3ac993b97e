"""README: "Two commands for a fresh machine" and "The main job": the recipes, scripts/main.sh,
scripts/test.sh and the slow selection, run as written."""

from __future__ import annotations

import json
import re

import pytest
from readme_helpers import (
    COVERED,
    SHORT,
    argv_of,
    readme_command,
    run,
    run_recipe,
    train_rows,
)


@pytest.mark.timeout(300)
def test_main_job_recipe(tmp_path):
    saved = run_recipe(readme_command("test_main_job_recipe"), tmp_path / "run")
    assert saved["summary"]["mode"] == "colocated" and saved["summary"]["steps"] == 2
    assert len(train_rows(saved)) == 2


@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_async_recipe(tmp_path):
    saved = run_recipe(readme_command("test_async_recipe"), tmp_path / "run")
    assert saved["summary"]["mode"] == "async" and len(train_rows(saved)) == 2


@pytest.mark.timeout(300)
def test_calculator_recipe(tmp_path):
    saved = run_recipe(readme_command("test_calculator_recipe"), tmp_path / "run")
    rows = train_rows(saved)
    assert saved["summary"]["recipe"] == "grpo_calculator" and len(rows) == 2
    assert all("rollout/turns_per_episode" in r and "rollout/tool_calls" in r for r in rows)


@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_multirun(tmp_path):
    argv, env = argv_of(readme_command("test_multirun"))
    run([*argv, *SHORT, f"hydra.sweep.dir={tmp_path}"], env)
    lrs = [json.loads((tmp_path / j / "metrics.json").read_text())["config"]["trainer"]["lr"]
           for j in ("0", "1")]  # fmt: skip
    assert lrs == [1e-3, 2e-3]


@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_main_sh_runs_the_main_job(tmp_path):
    """Installs into .venv (scripts/setup_env.sh) like a fresh machine, then runs the recipe."""
    for i, command in enumerate(
        c for c, t in COVERED.items() if t == "test_main_sh_runs_the_main_job"
    ):
        argv, env = argv_of(readme_command("test_main_sh_runs_the_main_job", command))
        out_dir = tmp_path / str(i)
        run([*argv, *SHORT, f"hydra.run.dir={out_dir}"], env, timeout=540)
        saved = json.loads((out_dir / "metrics.json").read_text())
        assert saved["summary"]["steps"] == 2


@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_test_sh_runs_pytest():
    """scripts/test.sh is `python -m pytest -q` after setup; both run here on one small file."""
    for command in ("bash scripts/test.sh", "python -m pytest -q"):
        argv, env = argv_of(readme_command("test_test_sh_runs_pytest", command))
        out = run([*argv, "-p", "no:cacheprovider", "tests/test_hashing.py"], env, timeout=540)
        assert re.search(r"\d+ passed", out.stdout), out.stdout[-2000:]


@pytest.mark.heavy
def test_slow_recipe_selection():
    """`pytest -m slow tests/test_recipes.py` selects the learning run (collected, not run)."""
    argv, env = argv_of(readme_command("test_slow_recipe_selection"))
    out = run([*argv, "--collect-only", "-q", "-p", "no:cacheprovider"], env, timeout=120)
    assert "test_rl_beats_the_warm_start" in out.stdout, out.stdout[-2000:]
