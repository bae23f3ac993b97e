"""README: "Growing from the embedded default": each row's overrides through the main job."""

from __future__ import annotations

import random
import shlex
import subprocess

import pytest
import torch
from readme_helpers import (
    ROOT,
    SHORT,
    argv_of,
    make_checkpoint,
    readme_command,
    run,
    run_recipe,
    train_rows,
)

from rollout.config import ConfigError, compose, validate


@pytest.mark.timeout(300)
@pytest.mark.heavy  # >10 s of real processes: out of the ~10-minute default suite
def test_more_engines(tmp_path):
    """dp engine processes behind the coordinator; coordinator counters are logged too."""
    command = readme_command("test_more_engines")
    dp = int(command.partition("=")[2])
    saved = run_recipe(command, tmp_path / "run")
    rows = train_rows(saved)
    assert len(rows) == 2 and saved["summary"]["final_version"] == 2
    assert all(r["engine/num_engines"] == dp for r in rows)
    assert all(r["coordinator/requests"] >= 8 for r in rows), rows[-1]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "architecture, bos",
    [("qwen2", False), pytest.param("llama", True, marks=pytest.mark.heavy),
     pytest.param("qwen3_moe", False, marks=pytest.mark.heavy)],
)  # fmt: skip
def test_hf_dir_checkpoint(tmp_path, architecture, bos):
    """A saved Llama / Qwen2 / Qwen3-MoE folder through the recipe; Qwen's tokenizers have no
    bos token."""
    from recipes.config import task_of
    from rollout.tokenizers import load_tokenizer

    ckpt = make_checkpoint(tmp_path / architecture, architecture, bos)
    tok = load_tokenizer(ckpt)
    assert (tok.bos_id is not None) == bos
    command = readme_command("test_hf_dir_checkpoint")
    placeholder = {"/ckpt/Qwen2.5-0.5B-Instruct": str(ckpt)}
    task = task_of(validate(compose(argv_of(command, **placeholder)[0][3:])))
    example = task.make_example(random.Random(0))
    bos_prefix = [tok.bos_id] if bos else []
    assert task.prompt_ids(example, tok) == [*bos_prefix, *tok.encode(example.prompt)]
    saved = run_recipe(command, tmp_path / "run", **placeholder)
    assert saved["config"]["model"]["path"] == str(ckpt)
    assert len(train_rows(saved)) == 2 and saved["summary"]["final_version"] == 2


def test_engine_gpu(tmp_path):
    """engine=gpu asks for CUDA (bf16): without CUDA it is a config error before any work."""
    overrides = shlex.split(readme_command("test_engine_gpu"))
    cfg = compose(overrides)
    assert cfg.model.device == "cuda" and cfg.model.dtype.name == "bfloat16"
    if torch.cuda.is_available():
        assert str(validate(cfg).model.device) == "cuda"
        return
    with pytest.raises(ConfigError, match=r"model\.device='cuda'.*CUDA is not available"):
        validate(cfg)
    argv, env = argv_of(readme_command("test_engine_gpu"))
    out = subprocess.run([*argv, f"hydra.run.dir={tmp_path}"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode != 0 and "CUDA is not available" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "metrics.json").exists()


@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_slurm_sweep_row(tmp_path):
    """The SLURM row's sweep through submitit's local executor (no SLURM here)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    command = readme_command("test_slurm_sweep_row")
    argv, env = argv_of(command, **{"submitit_slurm": "submitit_local"})
    run([*argv, *SHORT, f"hydra.sweep.dir={tmp_path}"], env)
    assert len(list(tmp_path.glob("*/metrics.json"))) == 2
