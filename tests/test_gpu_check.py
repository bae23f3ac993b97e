"""scripts/gpu_check.py: its CPU mode runs every stage that means something without a GPU and
passes, so the one-command GPU proof cannot rot between the rare runs on a GPU machine."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.py"
STAGES = ["environment", "cuda_tests", "hf_parity", "suspend_memory", "ipc_weight_sync",
          "throughput", "decode_profile", "grpo_recipe", "staged_update"]  # fmt: skip


def run_check(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)  # fmt: skip
    return proc, json.loads(out.read_text())


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_mode_passes_every_cpu_stage(tmp_path):
    proc, report = run_check(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert report["device"] == "cpu" and report["all_passed"] is True
    assert list(report["stages"]) == STAGES
    for name, stage in report["stages"].items():
        assert {"status", "seconds", "budget_s", "error", "checks", "details"} <= stage.keys()
        assert stage["seconds"] <= stage["budget_s"], name
    stages = report["stages"]
    assert stages["cuda_tests"]["status"] == "skipped"
    assert stages["ipc_weight_sync"]["status"] in ("passed", "not_available")
    for name in ("environment", "hf_parity", "suspend_memory", "throughput", "decode_profile",
                 "grpo_recipe", "staged_update"):  # fmt: skip
        assert stages[name]["status"] == "passed", (name, stages[name]["error"])
        assert stages[name]["checks"] and all(stages[name]["checks"].values()), name
    parity = stages["hf_parity"]["details"]
    assert parity["float32"]["max_abs_logprob_diff"] <= 1e-4
    assert parity["float32"]["untied_divergences"] == 0
    memory = stages["suspend_memory"]["details"]
    # CPU twin of mem_get_info: the process RSS drops by the pool when recompute frees it.
    assert memory["recompute"]["reported_freed_bytes"] == memory["pool_bytes"]
    assert (
        abs(memory["recompute"]["device_got_back_bytes"] - memory["pool_bytes"])
        <= (memory["tolerance_bytes"])
    )
    assert memory["persist"]["reported_freed_bytes"] == 0
    assert len(stages["throughput"]["details"]["runs"]) == 2
    assert stages["decode_profile"]["details"]["eager"]["wall_ms_per_step"] > 0
    assert len(stages["grpo_recipe"]["details"]["rewards"]) == 3
    assert (tmp_path / "gpu_check.png").stat().st_size > 0  # throughput and decode-step plot
    log = (tmp_path / "gpu_check.log").read_text()
    assert all(f"=== {name}" in log for name in STAGES)


def test_a_stage_past_its_budget_fails_and_the_run_goes_on(tmp_path):
    proc, report = run_check(tmp_path, "--stages", "environment", "hf_parity",
                             "--budget-scale", "0.001")  # fmt: skip
    assert proc.returncode == 1
    assert report["all_passed"] is False and list(report["stages"]) == ["environment", "hf_parity"]
    for stage in report["stages"].values():
        assert stage["status"] == "failed" and "timed out" in stage["error"]


def test_stage_outcomes(script, tmp_path, monkeypatch):
    def failing_check(ctx):
        ctx.check("fine", True)
        ctx.check("numbers_agree", False)

    def raises(ctx):
        raise RuntimeError("boom")

    def not_here(ctx):
        raise script.NotAvailable("no such module")

    for fn in (failing_check, raises, not_here):
        monkeypatch.setitem(script.STAGES, fn.__name__, (fn, 1, 1))
    result = script.run_stage_here("failing_check", "cpu", tmp_path, 1)
    assert result["status"] == "failed" and result["error"] == "checks failed: numbers_agree"
    assert result["checks"] == {"fine": True, "numbers_agree": False}
    result = script.run_stage_here("raises", "cpu", tmp_path, 1)
    assert result["status"] == "failed" and result["error"] == "RuntimeError: boom"
    assert script.run_stage_here("not_here", "cpu", tmp_path, 1)["status"] == "not_available"
